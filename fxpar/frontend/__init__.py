"""The frontend: an ordinary `nn.Module` and example inputs become one annotated aten graph.

`torch.export` captures it; these modules check what it captured and read the batch's rules.
"""
