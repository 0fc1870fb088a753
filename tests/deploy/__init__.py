"""Tests of the container, nginx, Kubernetes and Grafana files under docker/ and deploy/."""
