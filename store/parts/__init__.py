"""The parts ``Store`` is assembled from: its public methods by area, one mixin per module, each method one read
or one write operation (a function of ``store.sql``) run through the paths ``parts.plumbing`` declares and
``store.store`` provides."""
