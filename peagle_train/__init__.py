"""P-EAGLE training and evaluation. Reads the feature store through ``stores``; never imports
``peagle_data``."""
