"""The `"pdv"` section of a DeepSpeed config: schema, loading, and one clear error per bad key.

Each capability owns its sub-schema (aggregation options live on the aggregator class, placement in
`placement/config.py`, ...); this module assembles them and turns pydantic's errors into lines that name
the full key path (`pdv.aggregation.type: ...`) with a did-you-mean hint for misspelt keys.
"""
from __future__ import annotations

import difflib
import json
import os
from typing import Any, Dict, List, Optional, Tuple, Type, Union

import yaml
from pydantic import ConfigDict, Field, ValidationError, ValidationInfo, field_validator

from .registry import RegistryError, did_you_mean, factory_errors


from .config_base import ConfigError, StrictModel, format_errors  # noqa: E402,F401

# --- sub-sections (each capability owns its schema) ----------------------------------------------
from .placement.config import PlacementConfig  # noqa: E402
from .policy.config import PolicyConfig, policy_plugins  # noqa: E402
from .init_search_config import InitSearchConfig  # noqa: E402
from .aggregation.faults_config import FaultsConfig  # noqa: E402
from .recovery.config import SnapshotsConfig  # noqa: E402
from .placement.check import placement_errors  # noqa: E402
from .user_errors import exit_if_uncaught  # noqa: E402


class AggregationConfig(StrictModel):
    """`pdv.aggregation`: `type` names a registered aggregator; the other keys are its options, checked
    against that aggregator's own `Options` model."""

    model_config = ConfigDict(extra="allow", validate_assignment=True)
    type: str = "mean"

    @property
    def options(self) -> Dict[str, Any]:
        return dict(self.model_extra or {})


class PDVConfig(StrictModel):
    """The whole `"pdv"` section."""

    aggregation: AggregationConfig = Field(default_factory=AggregationConfig)
    placement: PlacementConfig = Field(default_factory=PlacementConfig)
    policy: PolicyConfig = Field(default_factory=PolicyConfig)
    init_search: InitSearchConfig = Field(default_factory=InitSearchConfig)
    faults: FaultsConfig = Field(default_factory=FaultsConfig)
    #: in-memory snapshots for resuming after a lost device or host (None: none; docs/recovery.md)
    snapshots: Optional[SnapshotsConfig] = None
    #: micro-batches per data-parallel replica of the step's global batch: "equal" (DeepSpeed's split), a
    #: list (one count >= 1 per replica, adding up to the step's micro-batches), or "by_throughput" (the
    #: best split for the devices' throughputs in `pdv.placement.cluster`); policies may change it later
    data_shares: Union[str, List[int]] = "equal"

    @field_validator("data_shares", mode="before")
    @classmethod
    def _data_shares(cls, v: Any, info: ValidationInfo) -> Any:
        if isinstance(v, str):
            if v not in ("equal", "by_throughput"):
                raise ValueError(f"must be 'equal', 'by_throughput' or a list of micro-batches per replica{did_you_mean(v, ['equal', 'by_throughput'])}")
            placement = info.data.get("placement")
            if v == "by_throughput" and placement is not None and placement.cluster is None:
                raise ValueError("'by_throughput' reads the devices' throughputs from pdv.placement.cluster, "
                                 "which is not set")
            return v
        if not isinstance(v, list) or not v or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in v):
            raise ValueError("must be 'equal', 'by_throughput' or a list of whole numbers >= 1 (micro-batches per "
                             "data-parallel replica)")
        return v


def aggregation_errors(section: Dict[str, Any], prefix: str = "pdv.aggregation") -> List[str]:
    """Check `type` against the registry and the remaining keys against that aggregator's options."""
    from .aggregation import AGGREGATORS, Aggregator

    name = section.get("type", "mean")
    if not isinstance(name, str):
        return [f"{prefix}.type: must be a string naming an aggregator (got {name!r})"]
    try:
        cls = AGGREGATORS.get(name)
    except RegistryError as exc:
        return [f"{prefix}.type: {exc}"]
    if not (isinstance(cls, type) and issubclass(cls, Aggregator)):  # only building it tells
        return factory_errors(cls, {k: v for k, v in section.items() if k != "type"}, Aggregator, name,
                              f"{prefix}.type")
    options_model = getattr(cls, "Options", None)
    opts = {k: v for k, v in section.items() if k != "type"}
    if options_model is None:
        return [f"{prefix}.{k}: unknown key; aggregator '{name}' takes no options" for k in opts]
    try:
        options_model.model_validate(opts)
    except ValidationError as exc:
        return format_errors(exc, options_model, prefix)
    return []


def validate_pdv(section: Any, prefix: str = "pdv") -> Tuple[Optional[PDVConfig], List[str]]:
    """Validate a `"pdv"` dict; returns (config or None, error lines)."""
    if section is None:
        section = {}
    if not isinstance(section, dict):
        return None, [f"{prefix}: must be an object/mapping (got {type(section).__name__})"]
    errors: List[str] = []
    cfg: Optional[PDVConfig] = None
    try:
        cfg = PDVConfig.model_validate(section)
    except ValidationError as exc:
        errors.extend(format_errors(exc, PDVConfig, prefix))
    agg = section.get("aggregation", {})
    if isinstance(agg, dict):
        # aggregation_errors reports a bad `type` itself (with the registry's hint): drop pydantic's line for it
        errors = [e for e in errors if not e.startswith(f"{prefix}.aggregation.type:")]
        errors.extend(aggregation_errors(agg, f"{prefix}.aggregation"))
    # cross-section checks owned by each capability
    if cfg is not None and not errors:
        for check in _CROSS_CHECKS:
            errors.extend(check(cfg, prefix))
    return (cfg if not errors else None), errors


#: whole-config checks `fn(cfg, prefix) -> list[str]`, run once every section is valid on its own
_CROSS_CHECKS: List[Any] = [policy_plugins]


def cross_check(fn):
    """Register one more whole-config check `fn(cfg, prefix) -> list[str]` (the built-in one: a policy naming
    an aggregator, `policy.config.policy_plugins`)."""
    _CROSS_CHECKS.append(fn)
    return fn


def read_file(path: Union[str, os.PathLike]) -> Dict[str, Any]:
    """Read a JSON or YAML file into a dict, with an error that names the file."""
    path = os.fspath(path)
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as exc:
        raise ConfigError([f"{path}: cannot read ({exc.strerror})"]) from exc
    try:
        data = json.loads(text) if path.endswith(".json") else yaml.safe_load(text)
    except (json.JSONDecodeError, yaml.YAMLError) as exc:
        raise ConfigError([f"{path}: not valid {'JSON' if path.endswith('.json') else 'YAML'}: {exc}"]) from exc
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError([f"{path}: top level must be an object"])
    return data


def find_section(data: Dict[str, Any]) -> Tuple[Any, Dict[str, Any], List[str]]:
    """(the pdv section, the rest of the config, errors about the top level) of a loaded config.

    The section is `data["pdv"]`, or the whole file when its top level holds pdv sections (Horovod users'
    YAML). DeepSpeed accepts unknown top-level keys silently, so a misspelt `"pdv"` or a pdv section put
    beside DeepSpeed's keys would otherwise be dropped without a word: both are errors here.
    """
    sections = list(PDVConfig.model_fields)
    found = [k for k in data if k in sections]
    if "pdv" in data:
        rest = {k: v for k, v in data.items() if k != "pdv"}
        return data["pdv"], rest, [f"{k}: a pdv section outside \"pdv\" is not read; move it into \"pdv\""
                                   for k in found]
    if found:
        others = [k for k in data if k not in sections]
        errors = [f"{k}: not a pdv section{did_you_mean(k, sections)}; the config is read as a bare pdv section "
                  f"(it has {', '.join(found)} at the top); in a DeepSpeed config put them under \"pdv\""
                  for k in others]
        return {k: data[k] for k in found}, {}, errors
    errors = [f"{k}: unknown top-level key (did you mean 'pdv'?); the pdv settings would be ignored"
              for k in data if difflib.get_close_matches(str(k).lower(), ["pdv"], n=1, cutoff=0.6)]
    return {}, dict(data), errors


#: the keys of `pdv.placement` that name files: in a config file, a relative path is read from the file's folder
PATH_KEYS = ("cluster", "plan", "profile")


def resolve_paths(cfg: PDVConfig, config_path: Union[str, os.PathLike], prefix: str = "pdv") -> List[str]:
    """Make the relative file paths of `cfg` (`pdv.placement.cluster`, `.plan`, `.profile`) absolute, read
    from the folder of the config file `config_path` (as a compiler reads an include), so that a config
    works from any working directory. Output folders (`pdv.policy.monitor.output_dir`) and `"module:Class"`
    plugin names are not paths of the config and stay as they are. Returns error lines for an input file
    (cluster, plan) that is not in the config's folder but is relative to the working directory: the old
    reading, named so that the fix is one edit."""
    base = os.path.dirname(os.path.abspath(os.fspath(config_path)))
    errors: List[str] = []
    pl = cfg.placement
    for key in PATH_KEYS:
        value = getattr(pl, key)
        if not value:
            continue
        given = os.path.expanduser(value)
        if os.path.isabs(given):
            if given != value:
                setattr(pl, key, given)
            continue
        resolved = os.path.normpath(os.path.join(base, given))
        if key != "profile" and not os.path.exists(resolved) and os.path.exists(given):
            errors.append(f"{prefix}.placement.{key}: '{value}' is read from the config file's folder ({base}), where "
                          f"it does not exist; it exists relative to the working directory: write "
                          f"'{os.path.relpath(os.path.abspath(given), base)}' (relative to the config) or an absolute "
                          "path")
        setattr(pl, key, resolved)
    return errors


def split_config(config: Union[None, str, os.PathLike, Dict[str, Any]]) -> Tuple[Dict[str, Any], PDVConfig]:
    """DeepSpeed config (path or dict) -> (DeepSpeed dict without `"pdv"`, validated PDVConfig).

    Raises ConfigError with every problem at once. A file holding only the pdv section (Horovod users'
    YAML) may also put it at top level (see `find_section`). For a file, the relative paths of the files
    it names are read from the file's folder (`resolve_paths`); for a dict, from the working directory.
    """
    from_file = isinstance(config, (str, os.PathLike))
    data = read_file(config) if from_file else dict(config or {})
    section, data, errors = find_section(data)
    cfg, more = validate_pdv(section)
    if cfg is not None and from_file and not errors and not more:
        more = resolve_paths(cfg, config)  # type: ignore[arg-type]
    if errors or more:
        raise ConfigError(errors + more)
    assert cfg is not None
    return data, cfg


@exit_if_uncaught  # a ConfigError nothing catches: its lines once, exit 2 (user_errors.py)
def load_pdv(config: Union[None, str, os.PathLike, Dict[str, Any], PDVConfig]) -> PDVConfig:
    """A PDVConfig from a PDVConfig, a `"pdv"` dict, a DeepSpeed config dict or a file path."""
    if isinstance(config, PDVConfig):
        return config
    return split_config(config)[1]


def topology_errors(section: Any, world_size: int, stages: Optional[int] = None, prefix: str = "pdv",
                    notes: Optional[List[str]] = None) -> List[str]:
    """Errors of a valid `"pdv"` dict on `world_size` ranks in `stages` pipeline stages (default: the
    placement section's `num_stages`, else 1), before launch. Every stage's data-parallel group then has
    m = world_size / stages ranks; an aggregation option that m cannot support is clamped at run time (one
    GroupSizeWarning): its line goes to `notes`, not to the errors (docs/aggregation.md, "Small groups")."""
    section = section if isinstance(section, dict) else {}
    placement = section.get("placement") if isinstance(section.get("placement"), dict) else {}
    key, planned = "num_stages", placement.get("num_stages")
    if planned is None and isinstance(placement.get("boundaries"), list) and len(placement["boundaries"]) >= 2:
        key, planned = "boundaries", len(placement["boundaries"]) - 1  # layer starts plus the layer count
    errors: List[str] = []
    if stages is None:
        stages = planned if isinstance(planned, int) and planned >= 1 else 1
    elif isinstance(planned, int) and planned != stages:
        errors.append(f"{prefix}.placement.{key}: {planned} stages in the config, but --stages {stages}")
    if world_size < 1:
        errors.append(f"--world-size: must be at least 1 (got {world_size})")
    if stages < 1:
        errors.append(f"--stages: must be at least 1 (got {stages})")
    elif world_size >= 1 and world_size % stages:
        errors.append(f"--stages: {world_size} ranks do not split into {stages} pipeline stages of equal "
                      f"data-parallel width (DeepSpeed gives every stage the same number of ranks)")
    if errors:
        return errors
    shares = section.get("data_shares")
    if isinstance(shares, list) and len(shares) != world_size // stages:
        errors.append(f"{prefix}.data_shares: {len(shares)} values, but {world_size} ranks in {stages} stage(s) make "
                      f"{world_size // stages} data-parallel replicas")
    from .aggregation.groups import group_notes

    agg = section.get("aggregation", {})
    clamped, errs = group_notes(agg if isinstance(agg, dict) else {}, world_size // stages)
    if notes is not None:
        notes.extend(clamped)
    return errors + errs


def global_micro_batches(ds_config: Dict[str, Any], replicas: int) -> Optional[int]:
    """Micro-batches in one step's global batch for `replicas` data-parallel replicas, from a DeepSpeed
    config's batch keys as DeepSpeed derives them (`train_batch_size` = micro-batch size x gradient
    accumulation steps x replicas; a missing key follows from the others, gradient accumulation defaults
    to 1); None when the keys do not fix it."""
    def whole(key: str) -> Optional[int]:
        v = ds_config.get(key)
        return v if isinstance(v, int) and not isinstance(v, bool) and v >= 1 else None

    batch, micro, gas = whole("train_batch_size"), whole("train_micro_batch_size_per_gpu"), \
        whole("gradient_accumulation_steps")
    if gas is not None:
        return gas * replicas
    if batch is not None and micro is not None:
        return batch // micro if batch % micro == 0 else None
    if batch is not None or micro is not None:
        return replicas  # one micro-batch per replica and step
    return None


def data_share_errors(section: Dict[str, Any], ds_config: Dict[str, Any], world_size: Optional[int] = None,
                      stages: Optional[int] = None, prefix: str = "pdv") -> List[str]:
    """A `data_shares` list that does not add up to the step's micro-batches (the launch refuses it, after
    the process group started): one replica per value, so the global batch of the DeepSpeed config's batch
    keys has `global_micro_batches(ds_config, len(shares))` micro-batches. The number of values against the
    world size is `topology_errors`' check."""
    shares = section.get("data_shares") if isinstance(section, dict) else None
    if not isinstance(shares, list) or not shares:
        return []
    replicas = len(shares)
    stages = stages or 1
    if world_size is not None and world_size % stages == 0 and world_size // stages != replicas:
        return []  # topology_errors names the count
    total = global_micro_batches(ds_config, replicas)
    if total is None or sum(shares) == total:
        return []
    keys = ", ".join(f"{k} {ds_config[k]}" for k in ("train_batch_size", "train_micro_batch_size_per_gpu",
                                                    "gradient_accumulation_steps") if k in ds_config)
    return [f"{prefix}.data_shares: {shares} add up to {sum(shares)} micro-batches, but the global batch has {total} "
            f"({keys} over {replicas} data-parallel replica{'s' if replicas != 1 else ''}); the shares split the "
            "step's batch, they do not change it"]


def check_file(path: str, world_size: Optional[int] = None, stages: Optional[int] = None,
               notes: Optional[List[str]] = None) -> List[str]:
    """Every error of the `"pdv"` section of a config file (empty when valid), including what the launch
    would load: the cluster YAML, plan and profile files and solver it names (`placement.check`; defaults a
    cluster fills go to `notes`). With `world_size` (and `stages`), also what that topology makes of it
    (`topology_errors`; clamped options go to `notes`). A file with no pdv section at all is an error: the
    launch would run it with every default, which `"pdv": {}` says on purpose."""
    try:
        data = read_file(path)
    except ConfigError as exc:
        return exc.errors
    section, _, errors = find_section(data)
    if not errors and "pdv" not in data and section == {}:
        return [f"{path}: no \"pdv\" section; pdv_ext would run this config with every default (mean aggregation, "
                "DeepSpeed's own placement, no policies): add \"pdv\": {} to mean that"]
    cfg, more = validate_pdv(section)
    errors = errors + more
    planned = None
    if cfg is not None and not errors:
        errors += resolve_paths(cfg, path)
    if cfg is not None and not errors:
        more, planned = placement_errors(cfg.placement, world_size, stages, notes)
        errors += more
    if cfg is not None and not errors:
        errors += data_share_errors(section, data if "pdv" in data else {}, world_size, stages or planned)
    if world_size is not None and not errors:
        errors += topology_errors(section, world_size, stages if stages is not None else planned, notes=notes)
    return errors
