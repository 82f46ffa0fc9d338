"""The option sets the engines read: one frozen (hashable) dataclass per loss, built by the public functions
after `contract` has checked the values. Hashable, so JAX takes them as static arguments."""
from dataclasses import dataclass

MEAN, SUM, NONE = 0, 1, 2
MODES = {"mean": MEAN, "sum": SUM, "none": NONE}
LOSS_TYPES = {"sigmoid": 0, "hinge": 1, "ipo": 2, "simpo": 3}
ENGINES = ("auto", "library", "fused")


@dataclass(frozen=True)
class Transform:
    """Raw logits r -> z: ``c * tanh(r / c)`` when `softcap`, then ``/ temperature`` (1.0: none)."""
    softcap: float | None = None
    temperature: float = 1.0

    @property
    def has_temperature(self) -> bool:
        return self.temperature != 1.0


@dataclass(frozen=True)
class FlceOptions:
    ignore_index: int = -100
    reduction: str = "mean"
    label_smoothing: float = 0.0
    z_loss: float = 0.0
    softcap: float | None = None
    token_scaling: bool = False
    chunk_rows: int | None = None
    engine: str = "library"

    @property
    def mode(self) -> int:
        return MODES[self.reduction]

    @property
    def transform(self) -> Transform:
        return Transform(softcap=self.softcap)


@dataclass(frozen=True)
class CpoOptions:
    seq_len: int
    ignore_index: int = -100
    beta: float = 0.1
    alpha: float = 1.0
    label_smoothing: float = 0.0
    loss_type: str = "sigmoid"
    simpo_gamma: float = 0.5
    average_log_prob: bool = False
    chunk_rows: int | None = None
    engine: str = "library"

    @property
    def loss_code(self) -> int:
        return LOSS_TYPES[self.loss_type]


@dataclass(frozen=True)
class LogprobOptions:
    ignore_index: int = -100
    softcap: float | None = None
    temperature: float = 1.0
    chunk_rows: int | None = None
    engine: str = "library"

    @property
    def transform(self) -> Transform:
        return Transform(softcap=self.softcap, temperature=self.temperature)
