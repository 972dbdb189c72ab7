"""Rules that need the memory plan (zeropipe.plan): too big, ZeRO-3 not needed, activations dominate."""

from __future__ import annotations


def plan_context(context):
    return None


def memory_problems(ctx):
    return []


def zero3_unneeded(ctx):
    return []


def activation_heavy(ctx):
    return []
