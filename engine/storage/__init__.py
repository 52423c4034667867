"""Storage tiers (gpu/cpu/disk), tensor handles, budgets, the one copy function. The placement rules (which
tier holds what) are the policy's: `engine.policy.placement`."""
from engine.storage.copy import copy
from engine.storage.tiers import BudgetExceeded, Handle, MemoryBudget, Stored, Tier

__all__ = ["copy", "BudgetExceeded", "Handle", "MemoryBudget", "Stored", "Tier"]
