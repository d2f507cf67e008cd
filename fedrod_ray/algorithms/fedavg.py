"""FedAvg (McMahan et al., 2017): plain local SGD, the sample-weighted average on the server.

Every hook of ``GenericRule`` already is FedAvg; this file only gives it its name.
"""

from __future__ import annotations

from .base import GenericRule
from .registry import register


@register
class FedAvg(GenericRule):
    name = "fedavg"
