"""A tiny kubelet for the local cluster's fake nodes: runs pods of known images as local processes."""
