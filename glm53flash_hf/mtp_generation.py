"""MTP self-speculative decoding for ``generate(use_mtp=True)`` through transformers' assisted decoding.

transformers 5.24 drives ``use_mtp=True`` with ``MTPCandidateGenerator`` (``generation/candidate_generator.py``),
which builds a generic ``MtpModel`` (``modeling_layers.py``) from the main model's last decoder layer class and
feeds it the post-norm ``hidden_states[-1]``. That does not fit this architecture: our main layers are mHC
layers over 4 streams returning tuples, and our MTP layer (:class:`~.modeling_glm53flash.Glm53FlashMTPLayer`,
DeepSeek-V3 technical report §2.2) is its own module that reads ``h_pre``, the mean over streams *before* the final
norm. :class:`Glm53FlashMTPCandidateGenerator` subclasses transformers' ``MTPCandidateGenerator`` and drafts with
our layer; the decoding loop, verification, acceptance (greedy match or ``_speculative_sampling``) and the cache
crop stay transformers' (``GenerationMixin._assisted_decoding``).

One draft token per step: the MTP layer at position ``t`` reads ``h_pre[t]`` of the main model and the embedding
of token ``t + 1`` and predicts token ``t + 2`` (depth 1 of :meth:`~.modeling_glm53flash.Glm53FlashTextModel.
mtp_forward`). The MTP layer keeps its own DSA cache (:class:`~.generation_cache.MtpDraftCache`) and only ever
sees verified positions, so it needs no rollback. The main model's cache is rolled back by transformers' crop
(:func:`~.generation_cache.make_croppable`).
"""

from __future__ import annotations

import torch
from transformers.generation.candidate_generator import MTPCandidateGenerator

from .generation_cache import MtpDraftCache, build_cache_context
from .packing import layout_from_kwargs

__all__ = ["Glm53FlashMTPCandidateGenerator", "text_model_of"]


def text_model_of(model):
    """The :class:`~.modeling_glm53flash.Glm53FlashTextModel` of a causal LM (``model.model``) or of the VL head
    (``model.model.language_model``)."""
    inner = model.model
    return getattr(inner, "language_model", inner)


class Glm53FlashMTPCandidateGenerator(MTPCandidateGenerator):
    """Drafts one token per step with the model's first MTP layer (``layers[num_hidden_layers]``).

    Contract of transformers' ``MTPCandidateGenerator.get_candidates``: the first call (before the prefill)
    returns the prompt unchanged; later calls get the main model's outputs of the last forward and
    ``n_last_matches`` (drafts accepted by that verification) and return ``(candidate_ids [1, L + 1],
    candidate_logits [1, 1, V])``; the logits are the processed logits the draft was taken from (argmax, or a
    sample when ``do_sample``), as ``MtpModel.forward`` returns them, so ``_speculative_sampling`` gets ``q``.

    The main forward is asked (``model_kwargs_overrides``) for ``output_mtp_inputs=True``: its output then carries
    ``pre_norm_hidden_state`` ``[1, S, D]`` and ``mtp_inputs_embeds`` ``[1, S, D]`` (the embeddings the layers read,
    vision features spliced in), so image placeholders are seen by the MTP layer as in training.

    Attributes:
        drafted, accepted: drafts proposed and drafts accepted so far (also written to ``model.mtp_stats``).
        mtp_calls: forwards of the MTP layer.

    Raises:
        ValueError: the model has no MTP layer (``num_nextn_predict_layers == 0``).
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
        self.text_model = text_model_of(main_model)
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
        batch = input_ids.shape[0]
        ctx = build_cache_context(self.mtp_cache, batch, num, self.device, mask)
        layout = layout_from_kwargs(batch, num, self.device, attention_mask=ctx.valid)
        out, _ = self.mtp_layer(embeds, h_pre, layout, cache=self.mtp_cache, cache_context=ctx)
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
