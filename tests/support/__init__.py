"""Helpers the tests share: plain-loop references, random drop-in rounds, bounded waits, GPU skip marks."""
