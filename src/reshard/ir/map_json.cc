// Placeholder: the JSON reader and writer are being written.
#include "reshard/ir/map_json.h"
