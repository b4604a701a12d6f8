"""Disaggregated serving: encode, prefill and decode workers, the transfers
between them and the router in front."""
