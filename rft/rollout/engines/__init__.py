"""Rollout engines: hf.py (transformers generate, the CPU default) and vllm.py (vLLM, with
vllm_worker.py for in-place weight updates). Both take token ids and give token ids and
sampling log-probs."""
