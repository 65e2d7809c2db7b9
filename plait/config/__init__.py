"""The typed configuration tree: YAML + dotted `--set` overrides, checked before anything loads.

Defaults live in `schema` and only there; they are the built-in demo (SmolLM2-135M-Instruct
learning to add inside \\boxed{} on a CPU).

    schema   the pydantic sections and `Config` (every option, its default and its meaning)
    load     `load_config`: a YAML file and overrides -> a `Config`; unknown keys name the nearest
    checks   `validate`: every problem at once, each with the values that would work; the BatchPlan

A *round* is one generation batch (generate -> score -> train); an *update* is one optimizer step.
"""

from plait.config.checks import CHECKS, Env, probe, resolve_backend, validate
from plait.config.load import apply_override, describe_options, load_config, unknown_keys, with_overrides
from plait.config.schema import (
    AlgoConfig,
    CheckpointConfig,
    ClusterConfig,
    Config,
    ConfigError,
    DataConfig,
    DeepSpeedConfig,
    EvalConfig,
    FsdpConfig,
    LogConfig,
    LoraConfig,
    ModelConfig,
    RayConfig,
    RewardSpec,
    RolloutConfig,
    SandboxConfig,
    Section,
    TrainConfig,
    TwoStageConfig,
    VllmSettings,
    WandbConfig,
    fast_precision,
)


__all__ = [
    "CHECKS",
    "AlgoConfig",
    "CheckpointConfig",
    "ClusterConfig",
    "Config",
    "ConfigError",
    "DataConfig",
    "DeepSpeedConfig",
    "Env",
    "EvalConfig",
    "FsdpConfig",
    "LogConfig",
    "LoraConfig",
    "ModelConfig",
    "RayConfig",
    "RewardSpec",
    "RolloutConfig",
    "SandboxConfig",
    "Section",
    "TrainConfig",
    "TwoStageConfig",
    "VllmSettings",
    "WandbConfig",
    "apply_override",
    "describe_options",
    "fast_precision",
    "load_config",
    "probe",
    "resolve_backend",
    "unknown_keys",
    "validate",
    "with_overrides",
]
