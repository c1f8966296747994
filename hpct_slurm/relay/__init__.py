"""A node's ranks behind one connection to the controller (issue 16): `coalesce` decides what
a relay forwards and when (pure; the benchmark's simulated nodes use it too, without torch),
`node` is the relay a node's first local rank runs (`NodeRelay`). Nothing is imported here, so
that `coalesce` stays light."""
