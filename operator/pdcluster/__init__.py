"""pdcluster-operator: disaggregated prefill/decode LLM serving on Kubernetes."""

__version__ = "0.1.0"
