"""Data: the Experience record (experience.py), its storages (buffer.py: queue, sql, file),
tasksets and generated tasks (tasks.py), dataset readers and prompt encoding (readers.py), the
chat template message by message (chat.py)."""
