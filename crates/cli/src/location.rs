//! Where a dict lives, as given on the command line ([`DictLocation`]: `shm:PREFIX`,
//! `file:PATH` for a consolidated file, or a folder): the one parser every subcommand uses, so
//! that `shm:PREFIX` means a shared dict and `file:PATH` a consolidated file everywhere.

use std::ffi::OsStr;

use clap::builder::TypedValueParser;
use tensordict::DictLocation;

/// [`DictLocation::parse`] for clap: a bad location is a usage error (exit 2).
#[derive(Clone, Copy, Debug)]
pub(crate) struct LocationParser;

impl TypedValueParser for LocationParser {
    type Value = DictLocation;

    fn parse_ref(
        &self,
        cmd: &clap::Command,
        arg: Option<&clap::Arg>,
        value: &OsStr,
    ) -> Result<DictLocation, clap::Error> {
        DictLocation::parse(value).map_err(|reason| {
            let name = arg.map_or_else(|| "LOCATION".to_owned(), ToString::to_string);
            clap::Error::raw(clap::error::ErrorKind::ValueValidation, format!("invalid value for {name}: {reason}\n"))
                .with_cmd(cmd)
        })
    }
}
