"""What the replica serves: the base model and the LoRA adapters loaded at run time.

Adapters stay servable once loaded; only `max_cpu_loras` of them are kept resident, so using
an evicted one costs a reload at schedule time (vLLM's CPU LoRA cache).
"""
from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field

from proxy.sim.config import SimConfig
from proxy.sim.errors import SimError, model_not_found


@dataclass
class Adapter:
    name: str
    path: str
    created: int = field(default_factory=lambda: int(time.time()))


class Models:
    def __init__(self, config: SimConfig) -> None:
        self.config = config
        self.base_id = config.model_id
        self.created = int(time.time())
        self.adapters: dict[str, Adapter] = {}
        self._resident: OrderedDict[str, None] = OrderedDict()
        self.loads = 0
        self.unloads = 0
        self.reloads = 0
        for name, path in config.lora_modules.items():
            self.adapters[name] = Adapter(name, path)
            self.make_resident(name)

    def resolve(self, model: object) -> str | None:
        """The adapter a request's `model` names, None for the base model (also when omitted, as vLLM)."""
        if model is None or model == self.base_id:
            return None
        if isinstance(model, str) and model in self.adapters:
            return model
        raise model_not_found(str(model))

    def make_resident(self, name: str) -> bool:
        """Mark `name` most recently used; True if it had to be (re)loaded."""
        resident = self._resident
        if name in resident:
            resident.move_to_end(name)
            return False
        resident[name] = None
        while len(resident) > max(self.config.cpu_lora_slots, 1):
            resident.popitem(last=False)
        return True

    def check_load(self, name: object, path: object) -> tuple[str, str]:
        if not isinstance(name, str) or not name or not isinstance(path, str) or not path:
            raise SimError(400, "Both 'lora_name' and 'lora_path' must be provided.")
        if name in self.adapters or name == self.base_id:
            raise SimError(400, f"The lora adapter '{name}' has already been loaded.", param="lora_name")
        if "invalid" in path:
            raise SimError(404, f"Loading lora {name} failed: No adapter found for {path}", param="lora_path")
        return name, path

    def add(self, name: str, path: str) -> None:
        self.adapters[name] = Adapter(name, path)
        self.make_resident(name)
        self.loads += 1

    def remove(self, name: object) -> None:
        if not isinstance(name, str) or not name:
            raise SimError(400, "'lora_name' needs to be provided to unload a LoRA adapter.")
        if name not in self.adapters:
            raise SimError(404, f"The lora adapter '{name}' cannot be found.", param="lora_name")
        del self.adapters[name]
        self._resident.pop(name, None)
        self.unloads += 1

    def cards(self) -> dict:
        """The /v1/models body, shaped like vLLM's ModelCard list."""
        data = [self._card(self.base_id, self.config.model, None, self.created, self.config.max_model_len)]
        data += [self._card(a.name, a.path, self.base_id, a.created, None) for a in self.adapters.values()]
        return {"object": "list", "data": data}

    @staticmethod
    def _card(id: str, root: str, parent: str | None, created: int, max_model_len: int | None) -> dict:
        return {
            "id": id, "object": "model", "created": created, "owned_by": "vllm", "root": root,
            "parent": parent, "max_model_len": max_model_len,
            "permission": [{
                "id": f"modelperm-{id}", "object": "model_permission", "created": created,
                "allow_create_engine": False, "allow_sampling": True, "allow_logprobs": True,
                "allow_search_indices": False, "allow_view": True, "allow_fine_tuning": False,
                "organization": "*", "group": None, "is_blocking": False,
            }],
        }
