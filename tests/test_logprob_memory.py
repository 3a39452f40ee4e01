"""What the trainer's log-probs hold in memory at a real vocabulary's width: the float32 [N, V]
tensors of one chunk of positions (rft/trainer/logprobs.py), counted by the bytes torch allocates
for them, as a ratio of one such tensor (not a time, not the machine's memory)."""

import pytest
import torch
from conftest import load_script

from rft.trainer import logprobs

# the benchmark's counter of what torch allocates (experiments/trainer_benchmark: --logprobs)
live_bytes = load_script("experiments/trainer_benchmark/benchmark.py", "trainer_benchmark").live_bytes


@pytest.mark.parametrize("entropy_grad", [True, False])
def test_a_chunks_log_probs_hold_few_float32_copies_of_its_logits(entropy_grad):
    """A bfloat16 output layer, as a bfloat16 model's, over 32 positions of a 151,936-token
    vocabulary (Qwen2.5's). Forward: the float32 logits (and their bfloat16 matmul a moment),
    then the log-softmax, then p log p (and a bool mask of the -inf log-probs, a quarter): at most
    2.25 [N, V] float32 tensors alive at once. It held 4: the float32 logits stayed referenced by
    the caller's frame through the entropy, and the entropy made a clamped copy of the log-probs
    beside p. Backward: the saved log-probs, the one gradient of the target's log-prob and the
    entropy together, and the log-softmax's gradient: 3. It held 4: a zero [N, V] for the gather's
    gradient and the sum of the two gradients."""
    N, V, H = 32, 151936, 64
    torch.manual_seed(0)
    h = torch.randn(N, H, dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(V, H) * 0.02).to(torch.bfloat16)
    targets = torch.randint(0, V, (N,))
    one = N * V * 4  # one float32 [N, V] tensor: 19,447,808 bytes
    with live_bytes(h, w, targets) as mem:
        logp, entropy = logprobs._chunk_logprobs(h, w, None, targets, torch.ones(N), None, None, entropy_grad)
        forward = mem.peak
        (logp.sum() + (entropy.sum() if entropy_grad else 0)).backward()
    assert forward <= 2.25 * one + 4096, forward / one
    assert mem.peak <= 3 * one + 4096, mem.peak / one
    assert mem.live < 0.01 * one  # nothing [N, V] outlives the step
    # the values are still the log-softmax's: log p(target) and -sum p log p of the same (bfloat16) logits
    want = torch.log_softmax(torch.nn.functional.linear(h.detach(), w).float(), dim=-1)
    assert torch.equal(logp.detach(), want.gather(-1, targets[:, None]).squeeze(-1))
    assert torch.allclose(entropy.detach(), -(want.exp() * want).sum(-1), rtol=1e-6)
    assert entropy.requires_grad is entropy_grad


def test_the_distillation_path_holds_what_the_memory_plan_counts():
    """On-policy distillation's JSD asks for the log-probs at the teacher's top tokens and the rest
    bucket beside them (`also`): at most 5 [N, V] float32 tensors at the backward's peak, the 20
    bytes a logit the memory plan counts for it (rft/plan/memory.py), 3.25 at the forward's."""
    N, V, H = 32, 151936, 64
    torch.manual_seed(0)
    h = torch.randn(N, H, dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(V, H) * 0.02).to(torch.bfloat16)
    targets, at = torch.randint(0, V, (N,)), torch.randint(0, V, (N, 20))
    one = N * V * 4
    with live_bytes(h, w, targets, at) as mem:
        logp, entropy, at_logp, at_rest = logprobs._chunk_logprobs(h, w, None, targets, torch.ones(N), None, None,
                                                                   True, 0, at, None)
        forward = mem.peak
        (logp.sum() + entropy.sum() + at_logp.sum() + at_rest.sum()).backward()
    assert forward <= 3.25 * one + 4096, forward / one
    assert mem.peak <= 5 * one + 4096, mem.peak / one
    assert at_logp.shape == (N, 20) and at_rest.shape == (N, 1)


def test_the_counter_counts_what_torch_allocates_and_frees():
    """live_bytes itself: a tensor made inside counts its bytes until it goes; one made before does not."""
    before = torch.ones(1000)
    with live_bytes(before) as mem:
        a = torch.empty(1000)  # 4,000 bytes
        b = before.view(10, 100)  # a view of a tensor made before: nothing new
        c = a * 2  # 4,000 more
        del a, c
    assert mem.peak == 8000 and mem.live == 0 and b.shape == (10, 100)
