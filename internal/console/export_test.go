package console

// OverviewReads is how many times c read the overview from the database.
func OverviewReads(c *Console) int64 { return c.reads.Load() }
