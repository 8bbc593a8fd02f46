"""The default task, `stdlib-lm`: a byte-level decoder-only transformer on the Python standard library.

Why this corpus: every machine that runs Starling has it (found with `sysconfig`), so a fresh node trains
with no download and no data set to ship, and source code is structured enough that the loss falls fast
and visibly.

Data, deterministically and without any global rank:
- the corpus is every `*.py` file under the stdlib directory (site-packages and caches skipped);
- validation files are chosen *by file* from a hash of their relative path (the same set on every peer);
- this peer's shard is the training files ordered by a hash of (PeerID, path), read until `data_bytes`
  are in hand: each peer starts somewhere else in the corpus, so any number of peers can join and their
  data differs (with overlap once budgets add up to more than the corpus);
- the stream walks non-overlapping windows of `seq_len + 1` bytes in a per-epoch permutation seeded by
  (seed, PeerID, epoch); its position is two integers, which is what makes resume exact.
"""

from __future__ import annotations

import hashlib
import math
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from node.config.train import TrainConfig
from node.worker.task import TaskContext, TaskError, fixed_val_batches, mean_loss

TASK_NAME = "stdlib-lm"
VOCAB = 256
DOC_SEPARATOR = b"\0"  # never appears in source text, so the model can learn where a file ends
_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}


# --- corpus -----------------------------------------------------------------------------------------------


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def list_sources(root: Path) -> list[str]:
    """Relative paths (with '/') of the `*.py` files under `root`, sorted; third-party dirs skipped."""
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS)
        for name in filenames:
            if name.endswith(".py"):
                found.append(Path(dirpath, name).relative_to(root).as_posix())
    found.sort()
    return found


def _hash64(*parts: str) -> int:
    return int.from_bytes(hashlib.sha256("\0".join(parts).encode()).digest()[:8], "big")


def is_validation(relpath: str, val_fraction: float) -> bool:
    """Whether a file belongs to the validation split: by a hash of its path, so the same on every peer."""
    return _hash64("val", relpath) < val_fraction * 2**64


def split_files(files: list[str], val_fraction: float) -> tuple[list[str], list[str]]:
    """(train, validation) file lists; disjoint, deterministic, independent of the PeerID."""
    train = [f for f in files if not is_validation(f, val_fraction)]
    val = [f for f in files if is_validation(f, val_fraction)]
    return train, val


def shard_order(files: list[str], peer_id: str) -> list[str]:
    """This peer's order of the training files: a hash of (PeerID, path) - no rank, no peer count."""
    return sorted(files, key=lambda f: _hash64("shard", peer_id, f))


def read_budget(root: Path, files: list[str], budget: int) -> bytes:
    """Concatenate files in the given order, separated by NUL, until `budget` bytes are read."""
    parts: list[bytes] = []
    total = 0
    for rel in files:
        if total >= budget:
            break
        try:
            data = (root / rel).read_bytes()
        except OSError:
            continue  # an unreadable file (permissions, a dangling link) is simply not part of the corpus
        data = data[: budget - total]
        parts.append(data)
        parts.append(DOC_SEPARATOR)
        total += len(data) + 1
    return b"".join(parts)


@dataclass
class Corpus:
    """The bytes one peer trains and validates on."""

    train: torch.Tensor  # uint8, this peer's shard
    val: torch.Tensor  # uint8, the shared validation text
    train_files: int
    val_files: int


def load_corpus(
    peer_id: str, data_bytes: int, val_fraction: float, seq_len: int, root: Path | None = None
) -> Corpus:
    """Read this peer's shard and the validation text (a tenth of the budget, at least 64 windows)."""
    root = stdlib_root() if root is None else root
    files = list_sources(root)
    train_files, val_files = split_files(files, val_fraction)
    val_budget = max(data_bytes // 10, 64 * (seq_len + 1))
    # Validation files in a fixed, peer-independent order, so every peer measures the same text.
    val_order = sorted(val_files, key=lambda f: _hash64("valorder", f))
    train = read_budget(root, shard_order(train_files, peer_id), data_bytes)
    val = read_budget(root, val_order, val_budget)
    need = 2 * (seq_len + 1)
    if len(train) < need or len(val) < need:
        raise TaskError(
            f"stdlib-lm: not enough Python source under {root} ({len(train)} train / {len(val)} validation "
            f"bytes; need at least {need}); is the standard library installed?"
        )
    return Corpus(
        train=torch.frombuffer(bytearray(train), dtype=torch.uint8),
        val=torch.frombuffer(bytearray(val), dtype=torch.uint8),
        train_files=len(train_files),
        val_files=len(val_files),
    )


# --- data stream ------------------------------------------------------------------------------------------


class WindowStream:
    """Batches of (input, target) byte windows, each epoch a fresh permutation of all windows.

    Position = (epoch, cursor); the permutation is recomputed from (seed, PeerID, epoch) on resume, so a
    restored stream yields exactly the batches the original would have.
    """

    def __init__(
        self, data: torch.Tensor, seq_len: int, batch_size: int, seed: int, peer_id: str, device: torch.device,
        task_name: str = TASK_NAME,
    ) -> None:
        self.data = data
        self.seq_len = seq_len
        self.batch_size = batch_size
        self.device = device
        self.windows = (len(data) - 1) // seq_len
        if self.windows < 1:
            raise TaskError(f"{task_name}: training text shorter than one sequence")
        self._seed_base = _hash64("stream", str(seed), peer_id) >> 1  # fits a torch seed (< 2**63)
        self.epoch = 0
        self.cursor = 0
        self._perm = self._permutation(0)
        self._offsets = torch.arange(seq_len + 1)

    def _permutation(self, epoch: int) -> torch.Tensor:
        g = torch.Generator().manual_seed((self._seed_base + epoch) % 2**63)
        return torch.randperm(self.windows, generator=g)

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        starts = []
        while len(starts) < self.batch_size:
            if self.cursor >= self.windows:
                self.epoch += 1
                self.cursor = 0
                self._perm = self._permutation(self.epoch)
            take = min(self.batch_size - len(starts), self.windows - self.cursor)
            starts.extend((self._perm[self.cursor : self.cursor + take] * self.seq_len).tolist())
            self.cursor += take
        idx = torch.tensor(starts).unsqueeze(1) + self._offsets
        chunk = self.data[idx].long()
        x, y = chunk[:, :-1], chunk[:, 1:]
        return x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "cursor": self.cursor, "windows": self.windows}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("windows") != self.windows:
            # The shard changed size (another Python version, budget or PeerID): keep the epoch, restart it.
            self.epoch, self.cursor = int(state.get("epoch", 0)), 0
        else:
            self.epoch, self.cursor = int(state["epoch"]), int(state["cursor"])
        self._perm = self._permutation(self.epoch)


# --- model ------------------------------------------------------------------------------------------------


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention, then a 4x GELU MLP."""

    def __init__(self, d_model: int, n_heads: int) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.ln1 = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.ln2 = nn.LayerNorm(d_model)
        self.fc = nn.Linear(d_model, 4 * d_model)
        self.out = nn.Linear(4 * d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.n_heads, d // self.n_heads).transpose(1, 2) for z in (q, k, v))
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class ByteTransformer(nn.Module):
    """A small GPT over bytes: learned positions, pre-norm blocks, untied output head."""

    def __init__(self, d_model: int, n_layers: int, n_heads: int, seq_len: int) -> None:
        super().__init__()
        self.seq_len = seq_len
        self.tok = nn.Embedding(VOCAB, d_model)
        self.pos = nn.Embedding(seq_len, d_model)
        self.blocks = nn.ModuleList(Block(d_model, n_heads) for _ in range(n_layers))
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, VOCAB, bias=False)
        self._init(n_layers)

    def _init(self, n_layers: int) -> None:
        # GPT-2 style: N(0, 0.02), residual projections scaled down by depth so early training is stable.
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)
        for block in self.blocks:
            for residual in (block.proj, block.out):
                nn.init.normal_(residual.weight, std=0.02 / math.sqrt(2 * n_layers))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        x = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


# --- the task ---------------------------------------------------------------------------------------------


class StdlibLMTask:
    """Byte-level language modelling on the stdlib sources (see the module docstring)."""

    name = TASK_NAME

    def __init__(
        self, cfg: TrainConfig, peer_id: str, device: torch.device, corpus: Corpus, accum_steps: int = 1
    ) -> None:
        self.cfg = cfg
        self.peer_id = peer_id
        self.device = device
        self.corpus = corpus
        self.accum_steps = accum_steps
        self._val_batches = fixed_val_batches(self.corpus.val, self.cfg, self.accum_steps, self.device)

    def fingerprint(self) -> dict[str, Any]:
        c = self.cfg
        return {"vocab": VOCAB, "d_model": c.d_model, "n_layers": c.n_layers, "n_heads": c.n_heads,
                "seq_len": c.seq_len, "seed": c.seed}

    def build_model(self) -> nn.Module:
        # Seeded by cfg.seed alone: every peer must start from the same weights.
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.cfg.seed)
            model = ByteTransformer(self.cfg.d_model, self.cfg.n_layers, self.cfg.n_heads, self.cfg.seq_len)
        return model.to(self.device)

    def train_stream(self) -> WindowStream:
        c = self.cfg
        return WindowStream(self.corpus.train, c.seq_len, c.batch_size, c.seed, self.peer_id, self.device)

    def loss(self, model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        logits = model(x)
        return F.cross_entropy(logits.reshape(-1, VOCAB).float(), y.reshape(-1))

    def evaluate(self, model: nn.Module) -> float:
        return mean_loss(self, model, self._val_batches, self.device, self.cfg.precision)



def make_task(ctx: TaskContext) -> StdlibLMTask:
    """The `train.task` factory: reads this peer's shard of the stdlib (bounded by train.data_bytes)."""
    if ctx.options:  # a [task] section meant for another task, or a typo: say so rather than ignore it
        raise TaskError(f"task.{sorted(ctx.options)[0]}: {TASK_NAME} takes no [task] options (its sizes are "
                        "train.d_model, train.n_layers, ...); remove the [task] section or set train.task")
    c = ctx.cfg
    corpus = load_corpus(ctx.peer_id, c.data_bytes, c.val_fraction, c.seq_len)
    return StdlibLMTask(c, ctx.peer_id, ctx.device, corpus, ctx.accum_steps)
