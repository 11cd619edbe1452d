"""Per-request sampling parameters, checked once when a request arrives."""

from __future__ import annotations

import math
from dataclasses import dataclass

# Above this, softmax(logits / T) is uniform to float32 precision: a larger value is a caller's mistake, not a setting.
MAX_TEMPERATURE = 100.0


@dataclass
class SamplingParams:
    temperature: float = 0.0  # 0 means greedy
    top_k: int = 0  # 0 or -1: disabled
    top_p: float = 1.0  # 1.0: disabled
    max_new_tokens: int = 128
    # Per-request seed: the same seed reproduces the same tokens whatever the batch. With speculative decoding,
    # whether a step speculates depends on the batch (a prefill in it does not), so a seed reproduces a run for
    # the same prompts and arrivals; the output distribution is the target's either way.
    seed: int | None = None
    stop: tuple[str, ...] = ()  # stop strings (the engine handles them)
    stop_token_ids: tuple[int, ...] | None = None  # None: the model's eos ids
    ignore_eos: bool = False

    def validate(self, vocab_size: int | None = None) -> None:
        """Raise ValueError naming the first bad parameter, so a request fails at admission rather than mid-batch."""
        t = self.temperature
        if not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
            raise ValueError(f"temperature must be >= 0 and finite, got {t!r}")
        if t > MAX_TEMPERATURE:
            raise ValueError(f"temperature must be <= {MAX_TEMPERATURE}, got {t!r}")
        if not isinstance(self.top_p, (int, float)) or not 0.0 < self.top_p <= 1.0:  # NaN fails the comparison
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise ValueError(f"top_k must be an int >= -1 (0 or -1 disables it), got {self.top_k!r}")
        if vocab_size is not None and self.top_k > vocab_size:
            raise ValueError(f"top_k must be <= vocab_size ({vocab_size}), got {self.top_k}")
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an int >= 1, got {self.max_new_tokens!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or self.seed < 0):
            raise ValueError(f"seed must be None or an int >= 0, got {self.seed!r}")
        if isinstance(self.stop, str) or not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(f"stop must be a tuple of non-empty strings, got {self.stop!r}")
        if self.stop_token_ids is not None:
            for tok in self.stop_token_ids:
                if not isinstance(tok, int) or tok < 0 or (vocab_size is not None and tok >= vocab_size):
                    raise ValueError(f"stop_token_ids must hold token ids in [0, vocab_size), got {tok!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
