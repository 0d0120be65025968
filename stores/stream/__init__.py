"""Streaming: the plan, the consumed cursor and the heartbeats a streaming run keeps in its feature store, behind
one session object (docs/design.md §7, "Streaming")."""
