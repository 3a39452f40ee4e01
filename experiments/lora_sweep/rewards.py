"""The study's reward: the response is the question's word reversed."""


def reversed_word(prompt: str, response: str, task) -> float:
    """1.0 when the response, stripped, is the word of `rev <word>` spelt backwards, else 0.0.

    Computed from the question itself (task.row["question"]), not from the answer column, so the
    reward is the task's definition; tests/test_user_study6.py checks both agree on every row."""
    word = task.row["question"].split()[-1]
    return float(response.strip() == word[::-1])
