"""Long-running chaos tests (marker ``soak``); ``--soak-minutes N`` runs them longer."""
