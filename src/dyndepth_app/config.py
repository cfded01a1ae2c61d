"""The demo's configuration: one dataclass, its ``--quick`` preset, and what may differ when a
checkpoint resumes."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields


def _eval(default):
    """A field that only affects evaluation: a checkpoint resumes under another value."""
    return field(default=default, metadata={"eval": True})


@dataclass(frozen=True)
class Config:
    # model
    width: int = 32
    dilations: tuple = (1, 2, 4, 8)  # of the four convs of the two residual blocks
    # training: strings of min_train_length..train_length bits (padded), n + k <= max_iters
    train_length: int = 64
    min_train_length: int = 4
    max_iters: int = 16  # M
    batch: int = 50
    # at most `steps` steps; once `converge_target` of the train_length-bit validation strings
    # are solved after M iterations (checked every `check_every` steps), `cooldown` more steps
    # at a tenth of the learning rate, then stop
    steps: int = 2500
    check_every: int = 50
    converge_target: float = 0.99
    cooldown: int = 300
    warmup: int = 50
    lr: float = 3e-3
    alpha: float = 1.0  # 1: progressive loss (random n, k); 0: the control, k = M always
    per_sample: bool = False
    seed: int = 0
    # evaluation: per length, accuracy after every iteration count until it has held >= target
    # from some count T through hold * T (at least eval_min_iters, at most eval_max_iters)
    eval_lengths: tuple = _eval((32, 64, 128, 512))
    eval_batch: int = _eval(1000)
    control_eval_batch: int = _eval(200)
    eval_target: float = _eval(0.99)
    eval_hold: int = _eval(4)
    eval_min_iters: int = _eval(128)
    eval_max_iters: int = _eval(800)
    eval_chunk: int = _eval(16)
    # adaptive evaluation: strings of adaptive_min_length..max(eval_lengths) bits, each
    # iterating until its predictions stay unchanged for `patience` iterations, or for at most
    # stop_budget iterations per bit
    adaptive_batch: int = _eval(256)
    adaptive_min_length: int = _eval(16)
    patience: int = _eval(3)
    stop_budget: float = _eval(1.0)
    adaptive_repeats: int = _eval(2)  # wall times: the fastest of this many rounds


# ``--quick``: a seconds-long smoke run. Flags given explicitly win over these values.
QUICK = dict(
    width=8,
    train_length=8,
    min_train_length=4,
    max_iters=4,
    batch=16,
    steps=20,
    check_every=10,
    cooldown=10,
    warmup=2,
    eval_lengths=(8, 16),
    eval_batch=32,
    control_eval_batch=16,
    eval_min_iters=16,
    eval_max_iters=32,
    eval_chunk=8,
    adaptive_batch=16,
    adaptive_min_length=4,
    patience=2,
    adaptive_repeats=1,
)


def training_fields(cfg):
    """The fields of ``cfg`` that define a training run (all but the evaluation ones)."""
    return {f.name: getattr(cfg, f.name) for f in fields(cfg) if not f.metadata.get("eval")}


def config_to_json(cfg):
    return asdict(cfg)


def config_from_json(values):
    """A :class:`Config` from :func:`config_to_json`'s dict (lists back to tuples). Raises
    ``TypeError`` for unknown fields."""
    values = {k: tuple(v) if isinstance(v, list) else v for k, v in values.items()}
    return Config(**values)


def replace(cfg, **changes):
    return Config(**{**asdict(cfg), **changes})
