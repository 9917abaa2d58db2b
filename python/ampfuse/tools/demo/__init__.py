"""`python -m ampfuse demo`: the digits training demo (digits.py) and its FSDP2 variant
(sharded.py)."""
