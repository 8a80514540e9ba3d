"""What every engine adapter (``dspark_vllm``, ``dspark_sglang``) shares, written once: the
options an engine passes to the remote drafter, checked, and the drafter folder's HELLO.
Torch-free, like the rest of ``dspark_client``; nothing here imports an engine."""
