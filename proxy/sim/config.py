"""Settings of one simulated replica, mirroring the vLLM flags they stand for."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SimConfig:
    model: str = "meta-llama/Llama-3.1-8B-Instruct"
    served_model_name: str | None = None
    lora_modules: dict[str, str] = field(default_factory=dict)  # name -> path, loaded at start
    max_loras: int = 1  # distinct adapters per running batch
    max_cpu_loras: int | None = None  # adapters kept resident; others are reloaded on use (None: max_loras)
    max_num_seqs: int = 64
    trust_request_mm_kwargs: bool = False
    block_size: int = 16
    num_gpu_blocks: int = 2048
    prefill_ms_per_token: float = 0.05  # per uncached prompt token
    itl_ms: float = 10.0
    time_scale: float = 1.0  # multiplies every simulated delay; 0 = never sleep
    default_max_tokens: int = 16
    max_model_len: int = 8192
    embedding_dim: int = 32
    lora_load_ms: float = 50.0
    api_key: str | None = None
    seed: int = 0

    @property
    def model_id(self) -> str:
        """The id clients use for the base model (vLLM: first --served-model-name, else --model)."""
        return self.served_model_name or self.model

    @property
    def cpu_lora_slots(self) -> int:
        return self.max_cpu_loras if self.max_cpu_loras is not None else self.max_loras

    def delay(self, ms: float) -> float:
        """Seconds to sleep for a simulated `ms`, after scaling."""
        return ms * self.time_scale / 1000.0
