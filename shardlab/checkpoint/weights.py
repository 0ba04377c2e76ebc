"""A model's weights outside training: read them whole from a checkpoint, write and read one safetensors file, and
start a run from either (checkpoint.init_from).

Two sources, one description: a step_N checkpoint folder (DCP shards + shardlab.json) or a consolidated
``model.safetensors`` with ``model.json`` beside it (task name, model config, the training config). Nothing here
unpickles a tensor file: safetensors and DCP only (its .metadata index through dcp_reader's MetadataUnpickler), JSON
for metadata. Reused by shardlab-consolidate, shardlab-generate and exporters.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

from shardlab.checkpoint.layout import META_MAX_BYTES, complete_checkpoints, read_meta
from shardlab.checkpoint.readers import dcp_reader
from shardlab.errors import CheckpointError, IncompatibleCheckpointError, first_cause
from shardlab.files.durable import follow_umask
from shardlab.files.regular_file import NotAFile, describe_os_error, read_regular, stat_file

MODEL_PREFIX = "model."
"""DCP flattens the saved {"model": ..., "optim": ...} into keys "model.<name>" and "optim.<...>"."""
EMA_PREFIX = "ema."
"""optimization.ema's average, saved as "ema.<name>" with the names of the model's parameters."""
WEIGHTS_FORMAT = "shardlab-weights/1"


def config_file(weights_file: Path) -> Path:
    """The JSON description beside a weights file: model.safetensors -> model.json."""
    return weights_file.with_suffix(".json")


def describe(path: Path) -> dict[str, Any]:
    """What ``path`` holds: {"task", "model_config", "config", "step"} from shardlab.json or the JSON beside a file."""
    path = Path(path).expanduser()
    if path.is_dir():
        meta = read_meta(path)
        task = meta.get("task") or meta.get("config", {}).get("task", {}).get("name")
        return {**meta, "task": task, "model_config": meta.get("model_config", {})}
    if not path.is_file():
        raise CheckpointError(f"{path} does not exist; {_existing_checkpoints(path)}")
    if path.suffix != ".safetensors":
        raise CheckpointError(f"{path} is not a .safetensors file; give one written by shardlab-consolidate")
    described = config_file(path)
    try:
        _regular(described)
        info = json.loads(read_regular(described.resolve(), max_bytes=META_MAX_BYTES))
    except (OSError, CheckpointError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(
            f"{described} (the model description beside {path.name}) is missing or unreadable ({e}); "
            "shardlab-consolidate writes it next to the weights"
        ) from e
    return info


def _existing_checkpoints(missing: Path) -> str:
    """The fix for a checkpoint path that does not exist: the complete checkpoints its folder holds (the newest few),
    else what to give."""
    found = complete_checkpoints(missing.parent)
    if not found:
        return "give a step_N checkpoint directory or a .safetensors file"
    shown = ", ".join(p.name for p in found[-5:])
    more = f"{len(found) - 5} older and " if len(found) > 5 else ""
    return f"{missing.parent} holds {more}{shown}; give one of those"


def training_config(path: Path, info: dict[str, Any], user_dir: str | None = None):
    """The config ``path`` (described by ``info``) was trained with, to rebuild its task in one process: its
    distributed section is the defaults (DCP loads any sharding into one process), and its ``user_dir`` is imported
    only when the caller names one (``--user-dir``): reading a checkpoint never runs code it names."""
    from omegaconf import OmegaConf

    from shardlab.config import DistributedConfig

    if not info.get("config"):
        raise CheckpointError(f"{path} carries no training config; it was not written by shardlab")
    cfg = OmegaConf.create(info["config"])
    cfg.distributed = OmegaConf.structured(DistributedConfig())
    recorded = cfg.get("user_dir")
    if recorded and not user_dir:
        raise CheckpointError(
            f"{path} was trained with plug-ins from user_dir={recorded}; a checkpoint's code is imported only where "
            f"you name it: pass --user-dir {recorded} (or where that folder is now) if you trust it"
        )
    if user_dir or "user_dir" in cfg:
        cfg.user_dir = user_dir or None
    return with_new_keys(cfg)


def with_new_keys(cfg):
    """``cfg`` as recorded by an earlier shardlab, with the keys added since at their current defaults: each section
    filled from its schema as registered now (the generic sections', and the task's, model's, optimizer's, schedule's
    and data's by the names ``cfg`` gives). Values it holds are kept; keys it holds that are gone stay for the
    caller's checks to name. The built-in optimizers and schedules need no registration here: their schemas are
    TrainConfig's own OptimizerConfig and LRSchedulerConfig (and optim/ is not checkpoint/'s to import)."""
    from omegaconf import OmegaConf

    from shardlab.config import TrainConfig, register_schemas
    from shardlab.registry import load_plugins

    register_schemas()
    load_plugins(cfg.get("user_dir"))
    defaults = OmegaConf.to_container(OmegaConf.structured(TrainConfig))
    names = {
        "task": cfg.task.get("name"),
        "model": cfg.get("model", {}).get("arch"),
        "optimizer": cfg.optimizer.get("name"),
        "lr_scheduler": cfg.lr_scheduler.get("name"),
        "data": cfg.task.get("name"),
    }
    for section, name in names.items():
        schema = _schema_defaults(section, name)
        if schema is not None:
            defaults[section] = schema
    return OmegaConf.create(_fill(OmegaConf.to_container(cfg), defaults))


def _schema_defaults(section: str, name: str | None) -> dict | None:
    """The defaults of the schema registered as ``schema/<section>/<name>`` (a task's, a model's, ...), or None when
    there is none of that name (a plug-in gone: the recorded section is then taken as it is)."""
    from hydra.core.config_store import ConfigStore
    from omegaconf import OmegaConf

    try:
        return OmegaConf.to_container(ConfigStore.instance().load(f"schema/{section}/{name}.yaml").node)
    except Exception:  # noqa: BLE001  (ConfigStore raises ConfigLoadError or its own lookup errors)
        return None


def _fill(recorded: dict, default: dict) -> dict:
    """``recorded`` with every key of ``default`` it lacks, at its default (nested sections too); MISSING stays out."""
    from omegaconf import MISSING

    for key, value in default.items():
        if key not in recorded and value != MISSING:
            recorded[key] = value
        elif isinstance(value, dict) and isinstance(recorded.get(key), dict):
            _fill(recorded[key], value)
    return recorded


def saved_model_config(info: dict) -> dict:
    """The model section a checkpoint recorded (``info``: ``describe``'s), with the keys its model's schema gained
    since at their defaults, which give the old behaviour (a Llama saved before ``qkv_bias`` or ``tie_embeddings``
    existed had neither): compared as recorded, None would differ from False and refuse a checkpoint of this very
    model. The installed plug-ins' schemas are looked up (a user_dir's are there when this run imported it: a
    checkpoint's recorded user_dir is never imported here)."""
    import copy

    from shardlab.registry import load_plugins

    saved = copy.deepcopy(info.get("model_config") or {})
    if "arch" not in saved:
        return saved
    load_plugins()
    schema = _schema_defaults("model", saved["arch"])
    return saved if schema is None else _fill(saved, schema)


def check_compatible(
    source: Path, info: dict, task_name: str, model_config: dict, ignore_keys: tuple[str, ...] = ()
) -> None:
    """Refuse weights of another task or model shape, naming the first key that differs; a key the checkpoint's
    model section predates counts as its default (``saved_model_config``)."""
    saved_task = info.get("task")
    if saved_task is not None and saved_task != task_name:
        raise IncompatibleCheckpointError(
            f"{source} was saved by task.name={saved_task!r} but this run has task.name={task_name!r}; "
            "use a checkpoint of this task, or run task.name={saved_task}"
        )
    saved = saved_model_config(info)
    keys = sorted((set(saved) | set(model_config)) - set(ignore_keys))
    diffs = [k for k in keys if saved.get(k) != model_config.get(k)]
    if diffs:
        k = diffs[0]
        raise IncompatibleCheckpointError(
            f"{source} was saved with model.{k}={saved.get(k)!r} but this run has model.{k}={model_config.get(k)!r}; "
            "use the checkpoint's model config, or start a new run in another hydra.run.dir"
        )


def stored_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """The shape of every model tensor ``path`` stores, by name, read from its index alone (a step folder's .metadata
    or a safetensors file's header): nothing is allocated."""
    path = Path(path).expanduser()
    if path.is_dir():
        metadata = dcp_reader.read_metadata(path, values=False)
        return {
            key.removeprefix(MODEL_PREFIX): tuple(item.size)
            for key, item in metadata.state_dict_metadata.items()
            if key.startswith(MODEL_PREFIX) and isinstance(item, TensorStorageMetadata)
        }
    from safetensors import safe_open

    _regular(path)
    try:
        with safe_open(str(path), "pt") as f:
            return {key: tuple(f.get_slice(key).get_shape()) for key in f.keys()}  # noqa: SIM118
    except Exception as e:
        raise CheckpointError(f"{path} could not be read as safetensors ({first_cause(e)})") from e


def check_shapes(path: Path, model: nn.Module) -> None:
    """Refuse ``model`` (built on the meta device from the config the checkpoint describes) unless every one of its
    tensors is stored at ``path`` with the same shape: the config in shardlab.json or model.json is the file's word,
    the index the tensors', and a model is materialized only once they agree."""
    stored = stored_shapes(path)
    for name, tensor in model.state_dict().items():
        if name not in stored:
            raise IncompatibleCheckpointError(
                f"{path} stores no {name}, which the model its config describes has; the config and the weights of "
                "this checkpoint disagree (a changed or foreign file)"
            )
        if tuple(tensor.shape) != stored[name]:
            raise IncompatibleCheckpointError(
                f"{path} stores {name} as {list(stored[name])} but the model its config describes has "
                f"{list(tensor.shape)}; the config and the weights of this checkpoint disagree (a changed or foreign "
                "file): refused before building the model"
            )


def _regular(path: Path) -> None:
    """A file the user named (a link is theirs to give) must be a regular file: not a FIFO, a device or a socket."""
    try:
        stat_file(path, follow_links=True)
    except NotAFile:
        raise CheckpointError(
            f"{path} is not a regular file; give a .safetensors file written by shardlab-consolidate"
        ) from None
    except OSError as e:
        raise CheckpointError(f"{path} {describe_os_error(path, e)}") from None


def check_ema_entries(path: Path, average: Iterable[str], model: Iterable[str]) -> None:
    """A step folder's EMA entries (``average``: their names without the ema. prefix) must exist and each name a
    model parameter (``model``: the model.* names), or the EMA weights cannot stand in for the model's."""
    average = set(average)
    if not average:
        raise CheckpointError(
            f"{path} holds no EMA weights (ema.* entries): its run had optimization.ema.enabled=false; drop the EMA "
            "option"
        )
    if unknown := sorted(average - set(model)):
        raise CheckpointError(f"{path}: EMA entry {unknown[0]!r} names no model parameter; is it a shardlab one?")


def read_full(path: Path, ema: bool = False) -> dict[str, torch.Tensor]:
    """The whole model state, unsharded, on the CPU, from a step_N folder (only the model.* entries of the DCP
    checkpoint are read: optimizer state never comes into memory) or a .safetensors file. ``ema``: the parameters are
    optimization.ema's average instead (the ema.* entries; buffers stay the model's), from a step_N folder only."""
    path = Path(path).expanduser()
    if ema:
        if not path.is_dir():
            raise CheckpointError(f"{path}: the EMA weights are in step_N checkpoint folders only; give one")
        state, average = _read_prefixed(path, MODEL_PREFIX), _read_prefixed(path, EMA_PREFIX)
        check_ema_entries(path, average, state)
        return {**state, **average}
    if not path.is_dir():
        from safetensors.torch import load_file

        _regular(path)
        try:
            return load_file(str(path))
        except Exception as e:
            raise CheckpointError(f"{path} could not be read as safetensors ({first_cause(e)})") from e
    state = _read_prefixed(path, MODEL_PREFIX)
    if not state:
        raise CheckpointError(f"{path} holds no model.* tensors; is it a shardlab checkpoint?")
    return state


def _read_prefixed(path: Path, prefix: str) -> dict[str, torch.Tensor]:
    """The tensors of step folder ``path`` whose DCP keys start with ``prefix`` ("model.", "ema."), by the rest of
    their key, unsharded on the CPU; {} if it holds none."""
    metadata = dcp_reader.read_metadata(path)
    state: dict[str, torch.Tensor] = {}
    for key, item in metadata.state_dict_metadata.items():
        if not key.startswith(prefix):
            continue
        if not isinstance(item, TensorStorageMetadata):
            raise CheckpointError(f"{path}: entry {key!r} is not a tensor; shardlab checkpoints hold only tensors")
        state[key.removeprefix(prefix)] = torch.empty(item.size, dtype=item.properties.dtype)
    if not state:
        return state
    try:
        dcp_reader.load({prefix.rstrip("."): state}, path, checked=True, no_dist=True)
    except (Exception, CheckpointException) as e:
        raise CheckpointError(f"checkpoint {path} could not be read ({first_cause(e)})") from e
    return state


def write_safetensors(state: dict[str, torch.Tensor], out: Path, info: dict[str, Any]) -> Path:
    """``state`` as one safetensors file and ``info`` (task, model_config, ...) as JSON beside it."""
    from safetensors.torch import save_file

    out.parent.mkdir(parents=True, exist_ok=True)
    # safetensors refuses tensors that share memory (tied embeddings); each key gets its own contiguous copy.
    save_file({k: v.detach().cpu().contiguous().clone() for k, v in state.items()}, str(out), {"format": "pt"})
    follow_umask(out)
    config_file(out).write_text(json.dumps({"format": WEIGHTS_FORMAT, **info}, indent=1))
    return out


def load_into(model: nn.Module, path: Path, checked: bool = False, keys: Callable[[str], bool] | None = None) -> None:
    """Load ``path``'s weights into ``model`` (plain, DDP or FSDP2-sharded, any world size; call on every rank).

    A step folder goes through DCP into the local shards (``checked``: its index was read through
    dcp_reader.read_metadata already); a safetensors file is read whole on every rank and each rank keeps its slice
    (set_model_state_dict with a full state dict). ``keys``: the model state keys to load (None: all; a LoRA run
    loads its frozen base, and its adapters keep their init)."""
    path = Path(path).expanduser()
    strict = keys is None
    if path.is_dir():
        state = {"model": {k: v for k, v in get_model_state_dict(model).items() if strict or keys(k)}}
        dcp_reader.load(state, path, checked=checked)
        set_model_state_dict(model, state["model"], options=StateDictOptions(strict=strict))
        return
    full = read_full(path)
    expected = {
        k for k in get_model_state_dict(model, options=StateDictOptions(full_state_dict=False)) if strict or keys(k)
    }
    missing, unexpected = sorted(expected - set(full)), sorted(set(full) - expected)
    if missing or unexpected:
        raise CheckpointError(
            f"{path} does not fit this model: missing {missing[:3]}, unexpected {unexpected[:3]}; "
            "consolidate a checkpoint of the same model"
        )
    set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, strict=strict))
