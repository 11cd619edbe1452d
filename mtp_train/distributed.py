"""Everything DeepSpeed: the process group, the ZeRO-wrapped head, its checkpoints and parameter gathering.

The trainer never imports deepspeed; it holds a `ZeroHead` and calls these methods. torchrun (or one plain
process) gives the ranks; gloo on CPU, nccl on GPU.
"""

from __future__ import annotations

import os
import random
import socket
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from omegaconf import DictConfig
from torch import nn


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init(device: str, timeout_s: float = 1800.0) -> tuple[int, int, torch.device]:
    """(rank, world_size, this rank's device). A plain `python -m` run becomes a world of one. A collective that
    waits on a peer for `timeout_s` raises instead of hanging (a peer on another node that died silently)."""
    if "RANK" not in os.environ:  # not launched by torchrun: a single-process world
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(_free_port()))
    use_cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    if not use_cuda:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed  # noqa: PLC0415 - after DS_ACCELERATOR is set

    if not use_cuda:  # DeepSpeed's CPU shared-memory all-reduce JIT-compiles for a minute: gloo is enough here
        sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None
    deepspeed.init_distributed(dist_backend="nccl" if use_cuda else "gloo", auto_mpi_discovery=False,
                               timeout=timedelta(seconds=timeout_s))
    rank, world = dist.get_rank(), dist.get_world_size()
    if use_cuda:
        local = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local)
        return rank, world, torch.device("cuda", local)
    return rank, world, torch.device("cpu")


def set_determinism(seed: int, deterministic: bool, device: torch.device) -> None:
    """Seed every RNG the run draws from (the head's initialisation, library internals) from the run's seed: torch
    seeds its default generator at random on import, so an unseeded run is another run. `deterministic` also makes
    CUDA pick deterministic kernels (cuBLAS workspace, attention backward); CPU kernels already are at a fixed
    thread count, and fp32 runs there are bitwise equal without it (tests/test_train_run.py)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)  # every device's default generator
    if deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # read when cuBLAS makes its first handle
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.benchmark = False
        if device.type == "cuda":
            torch.backends.cuda.matmul.allow_tf32 = False


def native_bf16(device: torch.device) -> bool:
    """Whether bf16 matmuls run natively on `device`, so that trainer.autocast pays: any CUDA GPU, or a CPU that
    oneDNN runs bf16 on (AVX512, AVX512-BF16, AMX); an AVX2-only CPU emulates them, several times slower than fp32
    (docs/benchmark_history.md)."""
    if device.type == "cuda":
        return True
    try:
        return device.type == "cpu" and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):  # a torch built without oneDNN
        return False


def all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(tensor)
    return tensor


def local_part() -> tuple[int, int]:
    """(this rank's index among its node's ranks, their number) under torchrun; (0, 1) in a world of one."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        return int(os.environ.get("LOCAL_RANK", 0)), int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    return 0, 1


def all_gather_lists(items: list) -> list:
    """Every rank's picklable items, concatenated in rank order (a world of one: its own items)."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        gathered: list = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, items)
        return [item for part in gathered for item in part]
    return list(items)


# What a collective raises on a rank whose peer has left the job (gloo's transport, NCCL's watchdog, c10d): the
# failure is the peer's, and its own message is the one to read.
_PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "remote worker crashing", "NCCL communicator was aborted")


def peer_failed(err: BaseException) -> bool:
    """Whether `err` is this rank's collective failing because another rank left (crashed, or stopped by an error)."""
    backend_errors = tuple(getattr(dist, name) for name in ("DistBackendError", "DistNetworkError") if hasattr(dist, name))
    return isinstance(err, backend_errors) or (isinstance(err, RuntimeError) and any(s in str(err) for s in _PEER_GONE))


def broadcast_object(obj: object) -> object:
    """Rank 0's picklable `obj` on every rank (a world of one: `obj`)."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]
    return obj


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def shutdown() -> None:
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def deepspeed_config(trainer: DictConfig) -> dict:
    """DeepSpeed's config from the `trainer` node (mtp_train.config.TrainerConfig)."""
    return {
        "train_micro_batch_size_per_gpu": 1,  # one packed micro batch per forward; its record count is ours
        "gradient_accumulation_steps": trainer.grad_accum,
        "gradient_clipping": trainer.grad_clip,
        "zero_optimization": {"stage": trainer.zero_stage},
        "bf16": {"enabled": trainer.dtype == "bfloat16"},
        "optimizer": {"type": "AdamW", "params": {"lr": trainer.lr, "betas": list(trainer.betas), "eps": 1e-8,
                                                  "weight_decay": trainer.weight_decay, "torch_adam": True}},
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
    }


# The DeepSpeed classes its optimizer checkpoints pickle beside tensors (ZeRO 1-3, fp32 and bf16), allowed by name
# so that checkpoints load with torch.load(weights_only=True): nothing else in them can run code.
DEEPSPEED_SAFE_GLOBALS = ("deepspeed.runtime.fp16.loss_scaler.LossScaler",
                          "deepspeed.runtime.zero.config.ZeroStageEnum",
                          "deepspeed.utils.tensor_fragment.fragment_address")


def _weights_only_checkpoint_engine(config):
    import importlib  # noqa: PLC0415

    from deepspeed.runtime.checkpoint_engine import TorchCheckpointEngine  # noqa: PLC0415

    class WeightsOnlyCheckpointEngine(TorchCheckpointEngine):
        """DeepSpeed's torch checkpoint engine, loading with weights_only=True."""

        def load(self, path: str, map_location=None):
            allowed = [getattr(importlib.import_module(m), a) for m, _, a in (g.rpartition(".") for g in
                                                                              DEEPSPEED_SAFE_GLOBALS)]
            with torch.serialization.safe_globals(allowed):
                return torch.load(path, map_location=map_location, weights_only=True)

    return WeightsOnlyCheckpointEngine(config)


class ZeroHead:
    """A module trained under DeepSpeed ZeRO: forward, backward and optimizer step, checkpoints, gathering."""

    def __init__(self, module: nn.Module, param_groups: list[dict], config: dict,
                 lr_factor: Callable[[int], float]) -> None:
        import deepspeed  # noqa: PLC0415

        self.module = module
        self.zero_stage = config["zero_optimization"]["stage"]
        self._engine, _, _, _ = deepspeed.initialize(
            model=module, model_parameters=param_groups, config=config,
            lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lr_factor),
        )
        from deepspeed.runtime.checkpoint_engine import TorchCheckpointEngine  # noqa: PLC0415

        if type(self._engine.checkpoint_engine) is not TorchCheckpointEngine:
            raise RuntimeError(f"DeepSpeed chose {type(self._engine.checkpoint_engine).__name__}; this trainer loads "
                               "checkpoints through its torch engine only (weights_only=True)")
        self._engine.checkpoint_engine = _weights_only_checkpoint_engine(self._engine._config)

    def __call__(self, *args, **kwargs):
        return self._engine(*args, **kwargs)

    def train(self) -> None:
        self._engine.train()

    def eval(self) -> None:
        self._engine.eval()

    def backward_and_step(self, loss: torch.Tensor) -> None:
        """DeepSpeed scales by 1 / grad_accum and steps the optimizer at each accumulation boundary."""
        self.backward(loss)
        self.step()

    def backward(self, loss: torch.Tensor) -> None:
        self._engine.backward(loss)

    def step(self) -> None:
        self._engine.step()

    @property
    def lr(self) -> float:
        return self._engine.get_lr()[0]

    @property
    def grad_norm(self) -> float:
        return float(self._engine.get_global_grad_norm() or 0.0)

    @contextmanager
    def gathered(self, params: list[nn.Parameter]) -> Iterator[None]:
        """Full parameters on every rank for the block (collective under ZeRO-3; a no-op below it)."""
        import deepspeed  # noqa: PLC0415

        with deepspeed.zero.GatheredParameters(params, modifier_rank=None, enabled=self.zero_stage == 3):
            yield

    def save(self, checkpoint_dir: str | Path, tag: str, client_state: dict) -> None:
        """Collective: every rank writes its shard of parameters and optimizer state into checkpoint_dir/tag
        (mtp_train.checkpoint publishes the folder and moves `latest`)."""
        self._engine.save_checkpoint(str(checkpoint_dir), tag=tag, client_state=client_state, save_latest=False)

    def load(self, checkpoint_dir: str | Path, tag: str) -> tuple[str | None, dict]:
        """(path loaded, client state) of checkpoint_dir/tag; (None, {}) when it cannot be loaded.

        Every file is read with torch.load(weights_only=True): a pickle that would build anything but tensors,
        containers and the DEEPSPEED_SAFE_GLOBALS raises pickle.UnpicklingError instead of running."""
        path, client_state = self._engine.load_checkpoint(str(checkpoint_dir), tag=tag)
        return path, client_state or {}
