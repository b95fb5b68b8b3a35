"""Adversarial workers, network simulation, scenarios and reports."""
