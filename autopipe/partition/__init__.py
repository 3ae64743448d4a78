"""Cutting a traced graph into pipeline stages: linear order, balance, plan."""
