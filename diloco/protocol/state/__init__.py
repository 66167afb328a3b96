"""A fragment's outer state::

fragment  FragmentState (outer params, momentum, version) and its one hash
transfer  serving and fetching outer states, validated; caps, hashes per snapshot
"""
