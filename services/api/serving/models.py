"""The models the api serves: the base model and its LoRA adapters (vLLM's serving_models).

A request's `model` picks one: the served model name (or no name) runs the base model, an
adapter's name runs that adapter, anything else is a 404. Adapters come from --lora-modules
at start-up and from POST /v1/load_lora_adapter later; each gets an id no other adapter of
this api ever gets, so an adapter loaded again under an old name is a new adapter to the
engines (their slots, host cache and prefix cache key on the id).

The api reads adapter_config.json with json only (shared/lora.py): it never imports torch.
An unloaded adapter is only forgotten here: requests already running with it finish, and
the engines drop its weights when their caches need the room.
"""

from __future__ import annotations

import itertools

from kvserve.services.api.serving.errors import APIError
from kvserve.services.api.serving.protocol import ModelCard
from kvserve.shared.config import LoRAConfig
from kvserve.shared.logging import init_logger
from kvserve.shared.lora import LoRAModulePath, LoRARequest, read_adapter_config

logger = init_logger(__name__)


class ServingModels:
    """
    Args:
        served_model_name: the base model's name in the API.
        model_root: what /v1/models reports as the base model's root (its path or name).
        lora_config: the engines' LoRA options; adapters need enable_lora.
        lora_modules: the adapters to serve from the start (a bad one raises ValueError).
    """

    def __init__(
        self,
        served_model_name: str,
        model_root: str,
        lora_config: LoRAConfig | None = None,
        lora_modules: list[LoRAModulePath] | None = None,
    ):
        self.served_model_name = served_model_name
        self.model_root = model_root
        self.lora_config = lora_config or LoRAConfig()
        self.lora_requests: dict[str, LoRARequest] = {}
        # (tool-call parser, reasoning parser) the chat surfaces use, shown on the card.
        self.parser_names: tuple[str | None, str | None] = (None, None)
        self._lora_ids = itertools.count(1)
        for module in lora_modules or ():
            try:
                self.load_lora_adapter(module.name, module.path, module.base_model_name)
            except APIError as exc:
                raise ValueError(f"--lora-modules {module.name}={module.path}: {exc}") from None

    @property
    def enable_lora(self) -> bool:
        return self.lora_config.enable_lora

    def lora_request(self, model: str | None) -> LoRARequest | None:
        """The adapter a request's `model` names; None for the base model.

        Raises:
            APIError: 404, as vLLM, for a name that is neither.
        """
        if model is None or model == self.served_model_name:
            return None
        lora_request = self.lora_requests.get(model)
        if lora_request is None:
            raise APIError(404, f"The model `{model}` does not exist.", param="model")
        return lora_request

    def load_lora_adapter(
        self, lora_name: str, lora_path: str, base_model_name: str | None = None
    ) -> LoRARequest:
        """Serve the PEFT folder at `lora_path` as model `lora_name`.

        Raises:
            APIError: 400 when LoRA is off, the name is taken, or the folder is not an
                adapter kvserve can run.
        """
        if not self.enable_lora:
            raise APIError(
                400, "LoRA adapters are not enabled: start the server with --enable-lora"
            )
        if not lora_name or not lora_path:
            raise APIError(400, "both `lora_name` and `lora_path` must be provided.")
        if lora_name in self.lora_requests or lora_name == self.served_model_name:
            raise APIError(
                400, f"The lora adapter '{lora_name}' has already been loaded.", param="lora_name"
            )
        try:
            read_adapter_config(lora_path, self.lora_config.max_lora_rank)
        except ValueError as exc:
            raise APIError(400, str(exc), param="lora_path") from None
        lora_request = LoRARequest(lora_name, next(self._lora_ids), lora_path, base_model_name)
        self.lora_requests[lora_name] = lora_request
        logger.info(
            "serving LoRA adapter %s (id %d) from %s",
            lora_name,
            lora_request.lora_int_id,
            lora_path,
        )
        return lora_request

    def unload_lora_adapter(self, lora_name: str) -> None:
        """Stop serving adapter `lora_name`.

        Raises:
            APIError: 400 when LoRA is off, 404 for a name that is not loaded.
        """
        if not self.enable_lora:
            raise APIError(
                400, "LoRA adapters are not enabled: start the server with --enable-lora"
            )
        if self.lora_requests.pop(lora_name, None) is None:
            raise APIError(
                404, f"The lora adapter '{lora_name}' cannot be found.", param="lora_name"
            )
        logger.info("LoRA adapter %s unloaded", lora_name)

    def model_cards(self, max_model_len: int) -> list[ModelCard]:
        """/v1/models' entries: the base model, then each adapter (parent: its
        base_model_name from --lora-modules, else the served model)."""
        tool_call_parser, reasoning_parser = self.parser_names
        cards = [
            ModelCard(
                id=self.served_model_name,
                root=self.model_root,
                max_model_len=max_model_len,
                tool_call_parser=tool_call_parser,
                reasoning_parser=reasoning_parser,
            )
        ]
        for lora in self.lora_requests.values():
            cards.append(
                ModelCard(
                    id=lora.lora_name,
                    root=lora.lora_path,
                    parent=lora.base_model_name or self.served_model_name,
                    max_model_len=max_model_len,
                )
            )
        return cards
