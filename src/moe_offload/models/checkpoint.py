"""Reading a Hugging Face checkpoint directory: config, quantization, and safetensors tensors by byte range.

The safetensors headers are parsed once into an index ``key -> (file, dtype, shape, byte range)``; tensors are
then read with positioned reads (``os.pread``) straight into their destination (a host store row, a model
parameter) — no memory map stays resident while loading, so the load never holds the checkpoint twice — or, for
``--host-store mmap``, described as byte ranges that the store maps itself.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..errors import MoeOffloadError, NotServedError
from .registry import architecture_for

#: safetensors dtype names -> torch dtypes
ST_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
             "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
             "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}
FLOAT8 = (torch.float8_e4m3fn, torch.float8_e5m2)
#: quantization methods the loader serves exactly (``quantization_config.quant_method``)
SUPPORTED_QUANT = ("fp8", "mxfp4")


def read_config(model_dir: str | Path):
    """Validate a checkpoint directory and return ``(path, config, architecture)``.

    Raises:
        MoeOffloadError: missing directory, a file (a GGUF file, a safetensors file...: ``not_a_checkpoint``), no
            config.json, no safetensors, a model type the installed transformers
            does not know (remote code is never run), one ``registry.REFUSED`` names, or a ``quantization_config``
            the engine does not serve exactly (``quantization``). Whether the model's experts can be served is
            decided when it is built (``models.capability``).
    """
    path = Path(model_dir)
    if not path.exists():
        raise MoeOffloadError(f"model directory not found: {path}")
    if not path.is_dir() or not (path / "config.json").is_file():
        raise MoeOffloadError(not_a_checkpoint(path))
    if not sorted(path.glob("*.safetensors")):
        raise MoeOffloadError(f"{path} has no *.safetensors weights")
    config, arch = read_config_json(path / "config.json")
    return path, config, arch


#: what ``--model`` takes (besides a built-in name)
CHECKPOINT_DIR = "a Hugging Face checkpoint directory (config.json + *.safetensors)"
_GGUF_MAGIC = b"GGUF"
_FILE_KINDS = {".safetensors": "a safetensors file", ".bin": "a PyTorch weights file", ".pt": "a PyTorch weights file",
               ".pth": "a PyTorch weights file", ".json": "a JSON file"}


def model_fingerprint(config_json: dict) -> str:
    """A model's identity for traces: ``model_type`` + 12 hex digits of the SHA-256 of its config.json (keys sorted,
    transformers' bookkeeping keys dropped), so a trace cannot be replayed against another model by mistake."""
    skip = {"transformers_version", "_name_or_path", "architectures", "dtype", "torch_dtype", "_experts_implementation"}
    canon = json.dumps({k: v for k, v in config_json.items() if k not in skip}, sort_keys=True)
    return f"{config_json.get('model_type', 'unknown')}-{hashlib.sha256(canon.encode()).hexdigest()[:12]}"


def checkpoint_model_id(model_dir: str | Path) -> str:
    """The identity of the checkpoint in ``model_dir`` that traces and predictors carry: ``model_fingerprint`` of its
    config.json; a checkpoint made from another with the same routers (``testbed-sparse-wide``: ``routing_model_id``
    in its ``testbed.json``) has that one's, so traces and predictors move between them."""
    model_dir = Path(model_dir)
    tb = model_dir / "testbed.json"
    if tb.is_file():
        rid = json.loads(tb.read_text()).get("routing_model_id")
        if rid:
            return rid
    return model_fingerprint(json.loads((model_dir / "config.json").read_text()))


def _is_gguf(path: Path) -> bool:
    """A GGUF file (llama.cpp's format): its magic bytes, or the ``.gguf`` suffix."""
    try:
        with path.open("rb") as f:
            head = f.read(4)
    except OSError:
        head = b""
    return head == _GGUF_MAGIC or path.suffix.lower() == ".gguf"


def not_a_checkpoint(path: Path) -> str:
    """One line saying what ``path``, which exists, is when it is not a checkpoint directory: a GGUF file, a
    safetensors or config.json file (naming the directory to give instead when it is one), another file, or a
    directory without config.json (and whether it holds GGUF files)."""
    if path.is_dir():
        ggufs = sorted(path.glob("*.gguf"))
        if ggufs and not (path / "config.json").exists():
            return (f"{path} holds GGUF files ({ggufs[0].name}{', ...' if len(ggufs) > 1 else ''}) and no "
                    f"config.json: moe-offload does not read GGUF; give {CHECKPOINT_DIR}")
        return f"{path} has no config.json: not {CHECKPOINT_DIR}"
    if not path.is_file():
        return f"{path} is neither a directory nor a regular file: give {CHECKPOINT_DIR}"
    if _is_gguf(path):
        return (f"{path} is a GGUF file (llama.cpp's format), which moe-offload does not read: give {CHECKPOINT_DIR} "
                "of the model instead")
    kind = "a config.json file" if path.name == "config.json" else _FILE_KINDS.get(
        path.suffix.lower(), f"a {path.suffix} file" if path.suffix else "a file")
    if (path.parent / "config.json").is_file() and path.suffix in (".safetensors", ".json"):
        return f"{path} is {kind}, not a directory: give the checkpoint directory holding it, {path.parent}"
    return f"{path} is {kind}, not a directory: give {CHECKPOINT_DIR}"


def read_config_json(file: str | Path):
    """``(config, architecture)`` of a ``config.json`` alone (``read_config`` without the weights: what can be
    checked before downloading them).

    Raises:
        MoeOffloadError: a GGUF file, not valid JSON, a model type the installed transformers does not know (remote
            code is never run), one ``registry.REFUSED`` names, or a ``quantization_config`` the engine does not serve
            exactly.
    """
    from transformers import CONFIG_MAPPING, AutoConfig

    file = Path(file)
    if file.is_file() and _is_gguf(file):
        raise MoeOffloadError(not_a_checkpoint(file))
    try:
        raw = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise MoeOffloadError(f"{file} is not valid JSON: {e}") from None
    except OSError as e:
        raise MoeOffloadError(f"cannot read {file}: {e.strerror}") from None
    model_type = raw.get("model_type")
    if model_type and model_type not in CONFIG_MAPPING:
        raise NotServedError(_unknown_type(model_type, raw))
    arch = architecture_for(model_type, CONFIG_MAPPING[model_type].__name__ if model_type else None)
    quantization(raw)
    try:
        config = AutoConfig.from_pretrained(file.parent) if file.name == "config.json" else \
            CONFIG_MAPPING[model_type].from_dict(raw)
    except Exception as e:  # transformers raises many kinds for bad configs
        raise MoeOffloadError(f"cannot read {file}: {e}") from None
    return config, arch


def _unknown_type(model_type: str, raw: dict) -> str:
    import transformers

    if raw.get("auto_map"):
        return (f"model_type {model_type!r} needs remote code (config.json auto_map), which moe-offload does not run;"
                f" the installed transformers {transformers.__version__} has no {model_type} (see moe-offload models)")
    return (f"model_type {model_type!r} is not known to the installed transformers {transformers.__version__} "
            "(see moe-offload models for the model types it serves)")


@dataclass(frozen=True)
class Quantization:
    """A checkpoint's quantization: ``method`` None (float weights), "fp8" (block FP8 e4m3 + ``weight_scale_inv``)
    or "mxfp4" (``*_blocks`` + ``*_scales``); ``block_size`` the FP8 ``weight_block_size`` or None."""

    method: str | None
    block_size: tuple[int, int] | None = None


def quantization(raw_config: dict) -> Quantization:
    """Read ``quantization_config`` from a raw config.json dict.

    Raises:
        MoeOffloadError: another ``quant_method``, FP8 in another format than e4m3, or static activation scales.
    """
    q = raw_config.get("quantization_config") or raw_config.get("text_config", {}).get("quantization_config")
    if not q:
        return Quantization(None)
    method = str(q.get("quant_method", "")).lower()
    if method not in SUPPORTED_QUANT:
        raise MoeOffloadError(f"quantization {method or '(no quant_method)'!r} is not supported; supported: "
                              "unquantized (bf16/fp16/fp32), fp8 (block-wise e4m3 + weight_scale_inv), mxfp4 (gpt-oss)")
    if method == "fp8":
        if str(q.get("fmt", "e4m3")).lower() != "e4m3":
            raise MoeOffloadError(f"fp8 format {q.get('fmt')!r} is not supported; supported: e4m3")
        if str(q.get("activation_scheme", "dynamic")).lower() != "dynamic":
            raise MoeOffloadError(f"fp8 activation_scheme {q.get('activation_scheme')!r} is not supported; "
                                  "supported: dynamic")
        bs = q.get("weight_block_size")
        return Quantization("fp8", tuple(int(b) for b in bs) if bs else None)
    return Quantization("mxfp4")


@dataclass(frozen=True)
class TensorInfo:
    """Where a tensor is: ``file``, ``dtype``, ``shape`` and absolute byte ``start`` in the file."""

    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * torch.empty(0, dtype=self.dtype).element_size()

    def row_range(self, index: int) -> tuple[int, int]:
        """``(start, nbytes)`` of row ``index`` of a fused ``[E, ...]`` tensor."""
        row = self.nbytes // self.shape[0]
        return self.start + index * row, row


def no_readahead(fd: int) -> None:
    """Ask the kernel not to read ahead on ``fd`` (``POSIX_FADV_RANDOM``); a filesystem that refuses is ignored."""
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
    except (OSError, AttributeError):
        pass


def read_header(f: Path) -> tuple[int, dict]:
    """``(data_start, header)`` of a safetensors file, read without read-ahead (which would bring the first tensors,
    experts among them, into the page cache).

    Raises:
        ValueError: a header length beyond the file's size, or a header that is not a JSON object.
        OSError: the file cannot be read."""
    with f.open("rb", buffering=0) as fh:
        no_readahead(fh.fileno())
        header_len = int.from_bytes(fh.read(8), "little")
        if header_len > f.stat().st_size:
            raise ValueError(f"header length {header_len} exceeds the file size")
        header = json.loads(fh.read(header_len))
    if not isinstance(header, dict):
        raise ValueError("header is not a JSON object")
    return 8 + header_len, header


class Checkpoint:
    """Index over a directory's safetensors files: ``key -> TensorInfo``; reads by byte range.

    Raises:
        MoeOffloadError: a file that is not valid safetensors (corrupt or truncated header, unknown dtype), a file
            shorter than its header says (truncated), or the same key in two files.
    """

    def __init__(self, path: Path):
        self.path = path
        self.index: dict[str, TensorInfo] = {}
        for f in sorted(path.glob("*.safetensors")):
            try:
                base, header = read_header(f)
                infos = {k: TensorInfo(f, ST_DTYPES[v["dtype"]], tuple(int(s) for s in v["shape"]),
                                       base + int(v["data_offsets"][0]))
                         for k, v in header.items() if k != "__metadata__"}
                need = base + max((int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"),
                                  default=0)
            except (ValueError, KeyError, TypeError, OSError, UnicodeDecodeError) as e:
                raise MoeOffloadError(f"{f.name} is not a readable safetensors file (bad header: {e})") from None
            size = f.stat().st_size
            if size < need:  # a truncated file keeps its header: check the data covers every tensor
                raise MoeOffloadError(f"{f.name} is truncated: {size} bytes, its header describes {need}")
            for k, info in infos.items():
                if k in self.index:
                    raise MoeOffloadError(f"tensor {k} is in both {self.index[k].file.name} and {f.name}")
                self.index[k] = info
        self._fds: dict[Path, int] = {}
        #: read without the kernel's read-ahead (``--host-store disk``: only the tensors asked for enter the page
        #: cache, never the experts beside them)
        self.random_access = False

    def keys(self) -> list[str]:
        return list(self.index)

    def info(self, key: str) -> TensorInfo:
        return self.index[key]

    def read_into(self, key: str, dst: np.ndarray, index: int | None = None) -> None:
        """Read tensor ``key`` (or row ``index`` of a fused ``[E, ...]`` tensor) into ``dst``, a contiguous numpy
        uint8 array of exactly its byte size, with one positioned read (no mapping stays resident).

        Raises:
            MoeOffloadError: a short read (file changed or truncated since indexing).
        """
        info = self.index[key]
        start, nbytes = (info.start, info.nbytes) if index is None else info.row_range(index)
        if dst.nbytes != nbytes:
            raise MoeOffloadError(f"{key}: {nbytes} bytes in the checkpoint, destination holds {dst.nbytes}")
        fd = self._fds.get(info.file)
        if fd is None:
            fd = self._fds[info.file] = os.open(info.file, os.O_RDONLY)
            if self.random_access:  # no read-ahead: it would pull the neighbouring experts into the page cache
                no_readahead(fd)
        view, done = memoryview(dst).cast("B"), 0
        while done < nbytes:
            n = os.preadv(fd, [view[done:]], start + done)
            if n <= 0:
                raise MoeOffloadError(f"cannot read tensor {key} from {info.file.name} (short read)")
            done += n

    def tensor(self, key: str, index: int | None = None) -> torch.Tensor:
        """Tensor ``key`` (or row ``index`` of it) as a new CPU tensor of its stored dtype."""
        info = self.index[key]
        shape = info.shape if index is None else info.shape[1:]
        t = torch.empty(shape, dtype=info.dtype)
        self.read_into(key, t.view(-1).view(torch.uint8).numpy() if t.numel() else np.empty(0, np.uint8), index)
        return t

    def close(self) -> None:
        """Close the file descriptors."""
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
