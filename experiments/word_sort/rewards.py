"""The study's reward, named by dotted path (experiments.word_sort.rewards.sorted_credit)."""


def sorted_credit(prompt: str, response: str, task, partial: float = 0.5) -> float:
    """1 for the letters in order; else `partial` times the share of positions that hold the
    right letter (a response of another length gets nothing: it is not the same letters)."""
    got, want = response.strip(), str(task.answer).strip()
    if got == want:
        return 1.0
    if len(got) != len(want):
        return 0.0
    return partial * sum(a == b for a, b in zip(got, want)) / len(want)
