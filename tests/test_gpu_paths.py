"""The branches that run only on CUDA, checked here for what they decide: which process group a
weight sync opens, and over which backends an FSDP2 rank talks. (tests/test_gpu.py runs them on a
GPU where one is visible.)"""

import datetime
import threading

import pytest
import torch
import torch.distributed as dist

from rft.sync.weights import broadcast, free_address, open_group


def test_a_cpu_member_of_the_weight_sync_group_uses_gloo_on_a_machine_with_a_gpu(monkeypatch):
    # a CPU run on a GPU machine (cluster.gpu_per_node=0): the trainer's and the hf engine's
    # tensors are on the CPU, which NCCL refuses; the group was chosen by the machine, not the tensors
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    sent, received = torch.tensor([1.0, 2.0, 3.0]), torch.zeros(3)
    port = free_address()[1]
    errors = []

    def explorer():
        try:
            broadcast(open_group("127.0.0.1", port, 2, 1, 30, torch.device("cpu")), [received])
        except Exception as e:  # (a thread's exception would not fail the test)
            errors.append(e)

    thread = threading.Thread(target=explorer)
    thread.start()
    broadcast(open_group("127.0.0.1", port, 2, 0, 30, "cpu"), [sent])
    thread.join(30)
    assert not errors and not thread.is_alive()
    assert received.tolist() == [1.0, 2.0, 3.0]


def test_a_gpu_member_of_the_weight_sync_group_uses_nccl_within_sync_timeout(monkeypatch):
    made = {}

    class Options:  # torch's CUDA build's ProcessGroupNCCL.Options (this CPU build has none)
        _timeout = datetime.timedelta(minutes=10)  # NCCL's own default

    class FakeNCCL:
        def __init__(self, store, rank, world, options=None):
            made.update(rank=rank, world=world, options=options)

    FakeNCCL.Options = Options
    monkeypatch.setattr(dist, "ProcessGroupNCCL", FakeNCCL, raising=False)
    group = open_group("127.0.0.1", free_address()[1], 1, 0, 7, torch.device("cuda", 0))
    assert isinstance(group, FakeNCCL) and made["rank"] == 0 and made["world"] == 1
    # synchronizer.sync_timeout (7 s here), not NCCL's 10 minutes
    assert made["options"]._timeout == datetime.timedelta(seconds=7)


@pytest.mark.slow  # composes a config and imports the trainer
def test_an_fsdp2_rank_on_a_gpu_has_gloo_beside_nccl_for_its_offloaded_cpu_shards(monkeypatch):
    # trainer.param_offload / critic_offload keep shards and gradients on the CPU: the gradient
    # clip's norm and their gathers are collectives of CPU tensors, which an NCCL-only group refuses
    # ("No backend type associated with device type cpu")
    from conftest import compose_cfg

    import rft.trainer.fsdp as fsdp
    from rft.plan.batch import make_plan, stage_configs

    class Started(Exception):
        pass

    def init_process_group(backend, **kwargs):
        raise Started(backend)

    cfg = stage_configs(compose_cfg(["stages=[]", "trainer=fsdp2", "trainer.ranks=1"]))[0]
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    monkeypatch.setattr(dist, "init_process_group", init_process_group)
    for device, backend in ((torch.device("cuda", 0), "cuda:nccl,cpu:gloo"), (torch.device("cpu"), "gloo")):
        monkeypatch.setattr(fsdp, "local_device", lambda cluster, d=device: d)
        with pytest.raises(Started) as e:
            fsdp.FSDPTrainer(cfg, make_plan(cfg, 2000), None, 0, 1, ("127.0.0.1", store.port))
        assert e.value.args == (backend,)
