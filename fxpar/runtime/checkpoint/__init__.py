"""Checkpoints: sharded ones that reshard (torch.distributed.checkpoint), checked byte by
byte, and the whole state gathered onto every rank.
"""
