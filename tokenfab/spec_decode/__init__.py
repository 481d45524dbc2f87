"""Speculative decoding: proposers (n-gram prompt lookup, a draft model), the rejection sampler that verifies
their drafts exactly, and the step that runs verification inside the engine's continuous batch.

Entry points: :func:`tokenfab.spec_decode.config.parse_speculative_config` (``speculative_config``) and
:class:`tokenfab.spec_decode.spec_decoder.SpecDecoder` (built by the engine when the config is set).
"""
