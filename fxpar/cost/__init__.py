"""The cost model: sympy formulas for compute, communication and memory per rank."""
