"""`hf-causal-lm`: a Hugging Face `transformers` causal language model trained on local text files.

    [train]
    task = "node.tasks.hf_causal_lm:make_task"
    [task]
    data = "/srv/text"                 # a text file, or a directory searched with data_glob
    model = { model_type = "gpt2", n_embd = 256, n_layer = 4, n_head = 4 }   # a fresh model, or:
    # pretrained = "/srv/models/my-gpt2"   # a local save_pretrained() directory (config + weights)
    # tokenizer = "/srv/models/my-gpt2"    # a local tokenizer directory; without one: UTF-8 bytes

Needs the `hf` extra (`pip install 'starling[hf]'`: transformers, safetensors). Nothing is ever
downloaded: a fresh model is built from its config (`AutoConfig.for_model`), a pretrained one and a
tokenizer are read with `local_files_only=True`, and the hub is switched off (`HF_HUB_OFFLINE=1`) before
transformers is imported.

Data, the way the default task does it (node/tasks/stdlib_lm.py): validation files are chosen by a hash
of their path (or `val_data` names them); when that leaves either side empty (a single file, say) the
last `train.val_fraction` of every file is held out instead. This peer's shard is the training files in
an order hashed from its PeerID, read up to `train.data_bytes`. Give every peer the same `val_data` for
validation losses that compare across the swarm.

The manifest: `model` (and every other option but the paths) is hashed into it through the `[task]`
section; the fingerprint adds the tokenizer's vocabulary and, for `pretrained`, a hash of the
directory's config and weight files, so that peers starting from different checkpoints never pair.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from node.config.train import TrainConfig
from node.tasks.stdlib_lm import WindowStream, is_validation, shard_order
from node.worker.task import TaskContext, TaskError, fixed_val_batches, mean_loss

TASK_NAME = "hf-causal-lm"
#: A fresh model when `[task] model` is not given: a 4-layer GPT-2 of width 128 (about 1M parameters
#: besides the embeddings) that trains visibly on a CPU.
DEFAULT_MODEL: dict[str, Any] = {"model_type": "gpt2", "n_embd": 128, "n_layer": 4, "n_head": 4}
OPTIONS = ("data", "data_glob", "val_data", "pretrained", "tokenizer", "model")
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".json")  # what fixes a pretrained model's initial weights


@dataclass(frozen=True)
class HFOptions:
    """The `[task]` options this task reads, checked."""

    data: Path
    data_glob: str = "**/*.txt"
    val_data: Path | None = None
    pretrained: Path | None = None
    tokenizer: Path | None = None
    model: Mapping[str, Any] | None = None

    @classmethod
    def parse(cls, options: Mapping[str, Any]) -> HFOptions:
        """TaskError (one line, naming the option) for a missing, unknown or ill-typed option: a typo in a
        free-form section must not be ignored silently."""
        unknown = sorted(set(options) - set(OPTIONS))
        if unknown:
            raise TaskError(f"task.{unknown[0]}: not an option of {TASK_NAME} (it reads {', '.join(OPTIONS)})")
        for name in ("data", "data_glob", "val_data", "pretrained", "tokenizer"):
            if name in options and not isinstance(options[name], str):
                raise TaskError(f"task.{name}: expected a string, got {options[name]!r}")
        if not options.get("data"):
            raise TaskError(f"task.data: {TASK_NAME} needs the text to train on: a file or a directory")
        model = options.get("model")
        if model is not None and not isinstance(model, Mapping):
            raise TaskError(f"task.model: expected a table such as {{ model_type = \"gpt2\", n_layer = 4 }}, got {model!r}")
        if model is not None and options.get("pretrained"):
            raise TaskError("task.model: leave it out when task.pretrained is set (the directory's config is used)")

        def path(name: str) -> Path | None:
            text = options.get(name) or ""
            return Path(text).expanduser() if text else None

        for name in ("data", "val_data", "pretrained", "tokenizer"):
            p = path(name)
            if p is not None and not p.exists():
                raise TaskError(f"task.{name}: {p} does not exist")
        for name in ("pretrained", "tokenizer"):
            p = path(name)
            if p is not None and not p.is_dir():
                raise TaskError(f"task.{name}: {p} is not a directory (expected one written by save_pretrained)")
        return cls(
            data=path("data"),  # type: ignore[arg-type]  # checked above
            data_glob=str(options.get("data_glob") or cls.data_glob),
            val_data=path("val_data"),
            pretrained=path("pretrained"),
            tokenizer=path("tokenizer"),
            model=dict(model) if model is not None else None,
        )


# --- tokens -----------------------------------------------------------------------------------------------


class ByteTokens:
    """No tokenizer: the token ids are the text's UTF-8 bytes (vocabulary 256, 0 ends a document)."""

    vocab_size = 256
    eos_id: int | None = 0

    def encode(self, data: bytes) -> list[int]:
        return list(data)

    def fingerprint(self) -> str:
        return "bytes"


class HFTokens:
    """A local Hugging Face tokenizer (`AutoTokenizer.from_pretrained(dir, local_files_only=True)`)."""

    def __init__(self, directory: Path) -> None:
        from transformers import AutoTokenizer

        try:
            self.tokenizer = AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
        except Exception as e:
            raise TaskError(f"task.tokenizer: cannot load a tokenizer from {directory}: {type(e).__name__}: "
                            f"{str(e).splitlines()[0] if str(e) else ''}") from e
        self.vocab_size = len(self.tokenizer)
        self.eos_id = self.tokenizer.eos_token_id

    def encode(self, data: bytes) -> list[int]:
        text = data.decode("utf-8", errors="replace")
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def fingerprint(self) -> str:
        vocab = sorted(self.tokenizer.get_vocab().items())
        return hashlib.sha256(json.dumps([vocab, self.eos_id]).encode()).hexdigest()


# --- text -------------------------------------------------------------------------------------------------


def list_text_files(path: Path, glob: str) -> dict[str, Path]:
    """{relative name: path} of the text files `path` names: itself, or its files matching `glob`."""
    if path.is_file():
        return {path.name: path}
    return {p.relative_to(path).as_posix(): p for p in sorted(path.glob(glob)) if p.is_file()}


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError:
        return b""  # an unreadable file is simply not part of the corpus, as in stdlib-lm


@dataclass
class TextSplit:
    """This peer's training text and the validation text, as documents (raw bytes)."""

    train: list[bytes]
    val: list[bytes]


def split_text(opts: HFOptions, peer_id: str, val_fraction: float, budget: int) -> TextSplit:
    """Training documents of this peer's shard (at most `budget` bytes) and the validation documents."""
    files = list_text_files(opts.data, opts.data_glob)
    if not files:
        raise TaskError(f"task.data: no file matches {opts.data_glob!r} under {opts.data}")
    if opts.val_data is not None:
        val_files = list_text_files(opts.val_data, opts.data_glob)
        if not val_files:
            raise TaskError(f"task.val_data: no file matches {opts.data_glob!r} under {opts.val_data}")
        train = {name: _read(p) for name, p in files.items()}
        val_docs = [_read(val_files[name]) for name in sorted(val_files)]
    else:
        held = {name for name in files if is_validation(name, val_fraction)}
        if held and held != set(files):
            train = {name: _read(p) for name, p in files.items() if name not in held}
            val_docs = [_read(files[name]) for name in sorted(held)]
        else:  # too few files to hold whole ones out: the tail of every file is validation text
            train, val_docs = {}, []
            for name in sorted(files):
                data = _read(files[name])
                cut = int(len(data) * (1 - val_fraction))
                train[name] = data[:cut]
                val_docs.append(data[cut:])
    shard, total = [], 0
    for name in shard_order(sorted(train), peer_id):
        if total >= budget:
            break
        piece = train[name][: budget - total]
        shard.append(piece)
        total += len(piece)
    return TextSplit(train=shard, val=val_docs)


def to_tokens(docs: list[bytes], tokens: ByteTokens | HFTokens) -> torch.Tensor:
    """The documents' token ids, each document followed by the end-of-document id (when there is one)."""
    ids: list[int] = []
    for doc in docs:
        if doc:
            ids.extend(tokens.encode(doc))
            if tokens.eos_id is not None:
                ids.append(tokens.eos_id)
    return torch.tensor(ids, dtype=torch.int32)


def files_digest(directory: Path) -> str:
    """sha256 over the names and contents of a pretrained directory's config and weight files."""
    sha = hashlib.sha256()
    for p in sorted(directory.iterdir()):
        if p.is_file() and p.suffix in _WEIGHT_SUFFIXES and not p.name.startswith("tokenizer"):
            sha.update(p.name.encode() + b"\0")
            with open(p, "rb") as f:
                while chunk := f.read(1 << 20):
                    sha.update(chunk)
    return sha.hexdigest()


# --- the task ---------------------------------------------------------------------------------------------


class HFCausalLMTask:
    """Next-token prediction with a `transformers` AutoModelForCausalLM (see the module docstring)."""

    name = TASK_NAME
    #: Paths to this machine's files may differ between peers; what they hold is fingerprinted instead.
    local_options = frozenset({"data", "data_glob", "val_data", "pretrained", "tokenizer"})

    def __init__(self, ctx: TaskContext, opts: HFOptions) -> None:
        self.cfg: TrainConfig = ctx.cfg
        self.peer_id = ctx.peer_id
        self.device = ctx.device
        self.accum_steps = ctx.accum_steps
        self.opts = opts
        self.tokens: ByteTokens | HFTokens = HFTokens(opts.tokenizer) if opts.tokenizer else ByteTokens()
        self.config = self._model_config()
        self._pretrained_digest = files_digest(opts.pretrained) if opts.pretrained else None
        c = self.cfg
        text = split_text(opts, ctx.peer_id, c.val_fraction, c.data_bytes)
        self.train_ids = to_tokens(text.train, self.tokens)
        self.val_ids = to_tokens(text.val, self.tokens)
        need = 2 * (c.seq_len + 1)
        if len(self.train_ids) < need or len(self.val_ids) < need:
            raise TaskError(f"task.data: {len(self.train_ids)} training / {len(self.val_ids)} validation tokens "
                            f"under {opts.data}; need at least {need} of each (train.seq_len = {c.seq_len})")
        self._val_batches = fixed_val_batches(self.val_ids, self.cfg, self.accum_steps, self.device)

    def _model_config(self) -> Any:
        from transformers import AutoConfig

        if self.opts.pretrained is not None:
            try:
                config = AutoConfig.from_pretrained(str(self.opts.pretrained), local_files_only=True)
            except Exception as e:
                raise TaskError(f"task.pretrained: no model config in {self.opts.pretrained}: {type(e).__name__}") from e
        else:
            spec = dict(self.opts.model if self.opts.model is not None else DEFAULT_MODEL)
            model_type = spec.pop("model_type", None)
            if not isinstance(model_type, str):
                raise TaskError('task.model: needs model_type, e.g. { model_type = "gpt2", n_layer = 4 }')
            spec.setdefault("vocab_size", self.tokens.vocab_size)
            if isinstance(self.tokens, ByteTokens):
                spec.setdefault("bos_token_id", 0)
                spec.setdefault("eos_token_id", 0)
            try:
                config = AutoConfig.for_model(model_type, **spec)
            except (ValueError, TypeError, KeyError) as e:
                raise TaskError(f"task.model: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from e
        if config.vocab_size < self.tokens.vocab_size:
            raise TaskError(f"task.model: vocab_size {config.vocab_size} is smaller than the tokenizer's "
                            f"{self.tokens.vocab_size}")
        for attr in ("n_positions", "max_position_embeddings"):
            limit = getattr(config, attr, None)
            if isinstance(limit, int) and limit < self.cfg.seq_len:
                raise TaskError(f"task.model: {attr} = {limit} is shorter than train.seq_len = {self.cfg.seq_len}")
        return config

    def fingerprint(self) -> dict[str, Any]:
        c = self.cfg
        return {"model_type": self.config.model_type, "seq_len": c.seq_len, "seed": c.seed,
                "tokenizer": self.tokens.fingerprint(), "pretrained": self._pretrained_digest}

    def build_model(self) -> nn.Module:
        from transformers import AutoModelForCausalLM

        # Seeded by cfg.seed alone: every peer must start from the same weights.
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.cfg.seed)
            if self.opts.pretrained is not None:
                try:
                    model = AutoModelForCausalLM.from_pretrained(str(self.opts.pretrained), local_files_only=True,
                                                                 dtype=torch.float32)
                except Exception as e:
                    raise TaskError(f"task.pretrained: cannot load {self.opts.pretrained}: {type(e).__name__}: "
                                    f"{str(e).splitlines()[0] if str(e) else ''}") from e
            else:
                model = AutoModelForCausalLM.from_config(self.config)
        return model.to(self.device)

    def train_stream(self) -> WindowStream:
        c = self.cfg
        return WindowStream(self.train_ids, c.seq_len, c.batch_size, c.seed, self.peer_id, self.device, TASK_NAME)

    def loss(self, model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        logits = model(input_ids=x, use_cache=False).logits
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), y.reshape(-1))

    def evaluate(self, model: nn.Module) -> float:
        return mean_loss(self, model, self._val_batches, self.device, self.cfg.precision)

    def save_pretrained(self, model: nn.Module, directory: Path) -> None:
        """`starling export --format hf`: the model, and the tokenizer when there is one, so that
        `from_pretrained(directory)` gives both back."""
        model.save_pretrained(str(directory))  # type: ignore[operator]
        if isinstance(self.tokens, HFTokens):
            self.tokens.tokenizer.save_pretrained(str(directory))


def make_task(ctx: TaskContext) -> HFCausalLMTask:
    """The `train.task` factory: reads the `[task]` options, this peer's shard of the text and the tokenizer."""
    opts = HFOptions.parse(ctx.options)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never reach the hub, whatever a config file names
    try:
        import transformers  # noqa: F401
    except ImportError as e:
        raise TaskError(f"{TASK_NAME} needs the transformers package: pip install 'starling[hf]' ({e})") from None
    return HFCausalLMTask(ctx, opts)
