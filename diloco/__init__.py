"""diloco-node: peer-to-peer Streaming DiLoCo (Douillard et al., 2025).

Subpackages import one way: ``codecs`` <- ``protocol`` <- ``node`` <- ``cli``;
``bench`` (benchmark drivers) sits beside ``cli``; ``sim`` imports only ``node``'s pure
schedule.
"""

__version__ = "0.1.0"
