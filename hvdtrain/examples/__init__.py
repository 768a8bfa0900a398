"""Models and data that ship with hvdtrain, so its examples train on real data with no download."""
