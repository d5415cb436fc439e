"""The data plane: every served model behind one facade for every transport."""
