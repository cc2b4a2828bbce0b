package main

// The reference of every setting: which heading a flag is listed under in
// --help and in docs/configuration.md (generated from the commands' own flag
// sets by TestConfigurationReference), what range a command accepts, and
// which guarantees of the design it serves. The flag's meaning is its usage
// string, written once where the flag is registered.

// Headings, in the order --help and the reference list them: the settings
// every deployment sets first, the tuning last.
const (
	groupCommand    = "Flags of this command"
	groupConnection = "Connections"
	groupNames      = "Table, slot and stream"
	groupDelivery   = "Delivery"
	groupHTTP       = "HTTP, metrics and console"
	groupLogging    = "Logging"
	groupTuning     = "Tuning (the defaults suit most deployments)"
	groupIgnored    = "Common flags this command accepts and ignores"
)

var groupOrder = []string{groupCommand, groupConnection, groupNames, groupDelivery, groupHTTP, groupLogging, groupTuning}

// setting is what the reference says about a flag beside its usage.
type setting struct {
	group string
	// limits is the range the command accepts, in words; refused is a value
	// outside it, which TestRunSettingLimits gives run and expects refused
	// with the flag named. Both empty: any value of the flag's type.
	limits, refused string
	// serves names the guarantees (G numbers of docs/guarantees.md) that
	// depend on the setting.
	serves string
}

// settingList has the common flags and run's, in the order --help lists
// them under each heading; a command's own flags (redrive
// --reason, prune --older-than, ...) are listed under groupCommand.
var settingList = []namedSetting{
	{flagDatabaseURL, setting{group: groupConnection}},
	{flagDBPasswordFile, setting{group: groupConnection, limits: "a readable file; not with --database-password-command", refused: "/nonexistent/password"}},
	{flagDBPasswordCommand, setting{group: groupConnection}},
	{flagDBIAM, setting{group: groupConnection, limits: "aws; not with --database-password-file or --database-password-command", refused: "gcp"}},
	{flagDBIAMRegion, setting{group: groupConnection}},
	{flagDBPooler, setting{group: groupConnection, limits: "none or transaction; transaction needs --replication-database-url for run", refused: "statement"}},
	{flagNATSURL, setting{group: groupConnection}},
	{flagNATSName, setting{group: groupConnection}},
	{flagNATSUser, setting{group: groupConnection}},
	{flagNATSPassword, setting{group: groupConnection}},
	{flagNATSToken, setting{group: groupConnection}},
	{flagNATSCreds, setting{group: groupConnection}},
	{flagNATSNKey, setting{group: groupConnection}},
	{flagNATSTLSCA, setting{group: groupConnection}},
	{flagNATSTLSCert, setting{group: groupConnection}},
	{flagNATSTLSKey, setting{group: groupConnection}},
	{"replication-database-url", setting{group: groupConnection, limits: "the same database as --database-url", refused: "postgres://[::1"}},
	{"nats-monitor-url", setting{group: groupConnection}},
	{"application-name", setting{group: groupConnection}},

	{flagTable, setting{group: groupNames, limits: "name or schema.name", refused: "a.b.c"}},
	{flagSlot, setting{group: groupNames, limits: "a replication slot name: lower-case letters, digits, _", refused: "Bad-Slot", serves: "G3, G9"}},
	{flagPublication, setting{group: groupNames, serves: "G9"}},
	{flagStream, setting{group: groupNames, limits: "a JetStream stream name", refused: "a.b"}},
	{flagSubjectPrefix, setting{group: groupNames, limits: "dot-separated tokens ending in '.'", refused: "outbox"}},
	{flagOnPublish, setting{group: groupNames, limits: "mark, delete or none", refused: "sometimes", serves: "G17"}},
	{"create-stream", setting{group: groupNames}},
	{"duplicate-window", setting{group: groupNames, limits: "at least 1s (shorter than --backoff-max or --lease: warned)", refused: "500ms", serves: "G18"}},
	{"stream-replicas", setting{group: groupNames, limits: "at least 1 (the broker refuses more than 5)", refused: "0"}},
	{"allow-stream", setting{group: groupNames, serves: "G7"}},
	{"failover-slot", setting{group: groupNames, serves: "G14"}},
	{"standby-slot", setting{group: groupNames, serves: "G14"}},

	{flagMessageFormat, setting{group: groupDelivery, limits: "outbox, cloudevents or cloudevents-structured", refused: "avro"}},
	{flagCloudEventsSource, setting{group: groupDelivery, limits: "a URI-reference (with --message-format cloudevents...)"}},
	{"ordering", setting{group: groupDelivery, limits: "none or aggregate", refused: "total", serves: "G12"}},
	{"deadline-margin", setting{group: groupDelivery, limits: "more than 0, at most 24h", refused: "25h", serves: "G13"}},
	{"deadline-ttl", setting{group: groupDelivery, serves: "G13, G21"}},
	{"atomic-transactions", setting{group: groupDelivery, serves: "G20"}},
	{"worker-id", setting{group: groupDelivery, serves: "G6"}},
	{"lease", setting{group: groupDelivery, limits: "longer than --ack-timeout", refused: "1s", serves: "G6"}},
	{"max-attempts", setting{group: groupDelivery, limits: "at least 1", refused: "0", serves: "G7"}},
	{"backoff-min", setting{group: groupDelivery, limits: "more than 0, at most --backoff-max", refused: "0s", serves: "G7"}},
	{"backoff-max", setting{group: groupDelivery, limits: "more than 0, at least --backoff-min (above the stream's duplicate window: warned)", refused: "0s", serves: "G18"}},

	{"http-addr", setting{group: groupHTTP}},
	{"console", setting{group: groupHTTP}},
	{"console-token", setting{group: groupHTTP, limits: "at least 16 bytes; required off loopback"}},
	{"console-read-only", setting{group: groupHTTP}},
	{"stats-interval", setting{group: groupHTTP, limits: "0 (never) or more", refused: "-1s", serves: "G16"}},

	{flagLogLevel, setting{group: groupLogging, limits: "trace, debug, info, warn, error", refused: "loud"}},
	{flagLogFormat, setting{group: groupLogging, limits: "json or console", refused: "xml"}},

	{"ack-timeout", setting{group: groupTuning, limits: "more than 0, shorter than --lease", refused: "0s"}},
	{"max-in-flight", setting{group: groupTuning, limits: "at least 1", refused: "0", serves: "G15"}},
	{"max-in-flight-bytes", setting{group: groupTuning, limits: "at least 1", refused: "0", serves: "G15"}},
	{"max-buffered-bytes", setting{group: groupTuning, limits: "at least 1", refused: "0", serves: "G15"}},
	{"linger", setting{group: groupTuning, limits: "0 (off) or more", refused: "-1s"}},
	{"adaptive-procs", setting{group: groupTuning}},
	{"status-interval", setting{group: groupTuning, limits: "more than 0", refused: "0s"}},
	{"drain-timeout", setting{group: groupTuning, limits: "more than 0", refused: "0s"}},
	{"poll-interval", setting{group: groupTuning, limits: "more than 0", refused: "0s"}},
	{"poll-batch", setting{group: groupTuning, limits: "at least 1", refused: "0"}},
	{"poll-pipeline", setting{group: groupTuning, limits: "at least 1", refused: "0"}},
	{"atomic-batch-max", setting{group: groupTuning, limits: "with --atomic-transactions: at most the server's max_batch_size", serves: "G20"}},
	{"readback-limit", setting{group: groupTuning, limits: "0 (off) or more", refused: "-1", serves: "G18"}},
	{"lost-check-interval", setting{group: groupTuning, limits: "0 (only at session starts) or more", refused: "-1s", serves: "G19"}},
}

type namedSetting struct {
	name string
	setting
}

// settings is settingList by name; rank is a flag's place in it, the order
// --help lists a heading's flags in (the ones most deployments set first).
var settings, rank = func() (map[string]setting, map[string]int) {
	m, r := map[string]setting{}, map[string]int{}
	for i, s := range settingList {
		m[s.name], r[s.name] = s.setting, i
	}
	return m, r
}()

// groupOf is the heading of a command's flag.
func groupOf(command, flag string) string {
	if s, ok := settings[flag]; ok && (command == "run" || isCommon(flag)) {
		return s.group
	}
	return groupCommand
}

func isCommon(flag string) bool {
	for _, f := range commonFlags {
		if f == flag {
			return true
		}
	}
	return false
}
