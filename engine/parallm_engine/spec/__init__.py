"""Speculative decoding: n-gram and draft-model proposals, verification, the policy."""
