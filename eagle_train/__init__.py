"""Training side of the EAGLE toolkit: conversation data, FR-Spec token maps, draft heads."""
