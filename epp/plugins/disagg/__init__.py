"""Prefill/decode disaggregation as plugins: endpoint roles and their filters
(``roles``), the deciders (``deciders``) and the profile handler (``handler``). What each
does, and how a pool is set up for it: docs/disaggregation.md."""

from epp.framework.endpoint import ROLE_LABEL
from epp.plugins.disagg.deciders import (
    AlwaysDecider,
    CacheAwareDecider,
    CacheAwareDeciderParams,
    LoadAwareDecider,
    LoadAwareDeciderParams,
    NeverDecider,
    NoDeciderParams,
    PrefixBasedDecider,
    PrefixDeciderParams,
)
from epp.plugins.disagg.handler import DisaggParams, DisaggProfileHandler
from epp.plugins.disagg.roles import DecodeFilter, PrefillFilter, RoleFilterParams, stages

__all__ = [
    "ROLE_LABEL", "AlwaysDecider", "CacheAwareDecider",
    "CacheAwareDeciderParams", "DecodeFilter", "DisaggParams", "DisaggProfileHandler",
    "LoadAwareDecider", "LoadAwareDeciderParams",
    "NeverDecider", "NoDeciderParams", "PrefillFilter", "PrefixBasedDecider",
    "PrefixDeciderParams", "RoleFilterParams", "stages",
]
