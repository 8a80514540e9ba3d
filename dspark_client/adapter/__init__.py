"""What every engine adapter (``dspark_vllm``, ``dspark_sglang``) shares, written once: the
options an engine passes to the remote drafter, checked, and the drafter folder's HELLO
(``options``); rank 0's table of engine rows to slots and generations (``slots``); the client
started from the options, the round that never raises and its target-only fill (``engine``).
Those are torch-free, like the rest of ``dspark_client``, and import no engine. ``device``,
the tap-row gather and the buffers a round is broadcast in, imports torch: only the adapters
import it."""
