"""A failed or hung worker: the survivors agree (agreement, decision), rebuild in-process
(recovery), watch the failure records while connecting, hand over RNG streams and retire old
groups."""
