"""Discrete-event simulator driving the product's own routing policy and planner."""
