"""Deployment on engines people already operate (Ray Serve; Kubernetes manifests live in deploy/)."""
