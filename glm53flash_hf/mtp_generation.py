"""MTP self-speculative decoding for ``generate(use_mtp=True)`` through transformers' assisted decoding.

:class:`Glm53FlashMTPCandidateGenerator` subclasses transformers 5.24's ``MTPCandidateGenerator``
(``generation/candidate_generator.py``) and drafts one token per step with our MTP layer (DeepSeek-V3 technical
report §2.2); verification, acceptance and the cache crop stay transformers' (``GenerationMixin._assisted_decoding``).
"""

from __future__ import annotations

import torch
from transformers.generation.candidate_generator import MTPCandidateGenerator

from .generation_cache import MtpDraftCache
from .packing import build_layout

__all__ = ["Glm53FlashMTPCandidateGenerator"]


class Glm53FlashMTPCandidateGenerator(MTPCandidateGenerator):
    """Drafts one token per step with the model's first MTP layer (``layers[num_hidden_layers]``).

    As ``MTPCandidateGenerator.get_candidates``: the first call returns the prompt, later calls ``(candidate_ids
    [1, L + 1], candidate_logits [1, 1, V])``. ``drafted`` / ``accepted`` / ``mtp_calls`` count (also
    ``model.mtp_stats``). Raises ``ValueError`` when the model has no MTP layer.
    """

    requires_model_outputs = True

    def __init__(self, main_model, generation_config, model_kwargs, logits_processor=None):
        config = main_model.config.get_text_config(decoder=True)
        if config.num_nextn_predict_layers < 1:
            raise ValueError(
                f"generate(use_mtp=True) needs an MTP layer: the model has num_nextn_predict_layers="
                f"{config.num_nextn_predict_layers}, expected >= 1"
            )
        self.num_mtp_layers = 1  # drafts per step (transformers' attribute name)
        self.model_kwargs_overrides = {"output_mtp_inputs": True}
        self.main_model = main_model
        self.text_model = getattr(main_model.model, "language_model", main_model.model)  # the causal LM's or VL's
        self.mtp_layer = self.text_model.layers[config.num_hidden_layers]
        self.lm_head = main_model.lm_head
        self.device = next(self.mtp_layer.parameters()).device
        self.mtp_cache = MtpDraftCache(config.num_hidden_layers)
        self.do_sample = generation_config.do_sample
        self.logits_processor = logits_processor
        self.is_main_model_prefill = True
        self.drafted = self.accepted = self.mtp_calls = 0
        self._proposed = 0
        main_model.mtp_stats = self.stats()

    def stats(self) -> dict:
        """``{"drafted", "accepted", "acceptance_rate", "mtp_calls"}`` (rate 0.0 before any draft)."""
        rate = self.accepted / self.drafted if self.drafted else 0.0
        return {"drafted": self.drafted, "accepted": self.accepted, "acceptance_rate": rate,
                "mtp_calls": self.mtp_calls}

    @torch.no_grad()
    def get_candidates(self, input_ids, model_kwargs, model_outputs, is_first_iteration, n_last_matches, **kwargs):
        """``input_ids`` ``[1, L]``: the sequence so far, ending with the token the last verification produced."""
        if is_first_iteration:
            self._proposed = 0
            return input_ids, None
        if getattr(model_outputs, "pre_norm_hidden_state", None) is None:
            raise ValueError("model_outputs must carry pre_norm_hidden_state (forward with output_mtp_inputs=True)")
        # positions of the last main forward whose next token is now known: the whole prompt after the prefill,
        # else the first token of the verification call and the accepted drafts
        num = input_ids.shape[1] - 1 if self.is_main_model_prefill else n_last_matches + 1
        h_pre = model_outputs.pre_norm_hidden_state[:, :num].to(self.device)
        embeds = model_outputs.mtp_inputs_embeds[:, 1:num].to(self.device)
        last = self.text_model.embed_tokens(input_ids[:, -1:].to(self.text_model.embed_tokens.weight.device))
        embeds = torch.cat([embeds, last.to(self.device, embeds.dtype)], dim=1)  # embedding of token t + 1

        mask = model_kwargs.get("attention_mask")
        mask = None if mask is None else mask[:, : input_ids.shape[1] - 1].to(self.device)
        layout = build_layout(input_ids.shape[0], num, self.device, attention_mask=mask, cache=self.mtp_cache)
        out, _ = self.mtp_layer(embeds, h_pre, layout, cache=self.mtp_cache)
        self.mtp_calls += 1
        self.is_main_model_prefill = False

        logits = self.lm_head(out[:, -1:].to(self.lm_head.weight.device))[:, -1].to(input_ids.device).float()
        if self.logits_processor is not None:
            logits = self.logits_processor(input_ids, logits)
        if self.do_sample:
            token = torch.multinomial(torch.softmax(logits, dim=-1, dtype=torch.float32), num_samples=1)
        else:
            token = logits.argmax(dim=-1, keepdim=True)
        self._proposed = 1
        return torch.cat([input_ids, token], dim=-1), logits[:, None, :]

    def update_candidate_strategy(self, input_ids, scores, num_matches):
        """Count drafts and accepted drafts (``num_matches``, after transformers' length/EOS cut)."""
        if self._proposed:
            self.drafted += self._proposed
            self.accepted += int(num_matches)
        self._proposed = 0
        self.main_model.mtp_stats = self.stats()
