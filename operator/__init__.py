"""kvfleet operator: reconciles ``InferenceService`` custom resources (group
``kvfleet.io``) into runtime pods, and scales and tunes them from live metrics."""
