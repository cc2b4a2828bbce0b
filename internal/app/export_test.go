package app

// TableStats is tableStats, the loop behind the table metrics, for the
// tests in package app_test.
var TableStats = tableStats
